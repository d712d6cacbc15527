"""Consistency axes: how each axis builds its (student, teacher) pairs and how it is evaluated."""
