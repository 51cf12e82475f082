"""Recipes: YAML shipped as package data, validated into typed dataclasses."""

from qconv.recipes.recipe import ROLES, Recipe, builtin_recipes, load_recipe

__all__ = ["ROLES", "Recipe", "builtin_recipes", "load_recipe"]
