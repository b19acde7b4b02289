"""Test doubles. Each module says what real thing it stands in for and where it departs from it."""
