"""Recipes: YAML shipped as package data, validated into typed dataclasses."""

from qconv.recipes.recipe import Recipe, builtin_recipes, load_recipe
from qconv.recipes.sections import ROLES

__all__ = ["ROLES", "Recipe", "builtin_recipes", "load_recipe"]
