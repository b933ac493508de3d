"""Attention backends: where K/V live between steps and how a step attends over them."""
