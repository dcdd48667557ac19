"""Autograd-aware collectives: all_gather whose backward is reduce_scatter, and the reverse."""

from __future__ import annotations
