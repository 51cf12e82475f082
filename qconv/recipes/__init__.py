"""Recipes: YAML shipped as package data, validated into typed dataclasses. The roles a recipe may name are the
model families' (qconv.models.family.all_roles)."""

from qconv.recipes.recipe import Recipe, builtin_recipes, load_recipe

__all__ = ["Recipe", "builtin_recipes", "load_recipe"]
