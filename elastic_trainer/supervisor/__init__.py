"""Supervisor side: one per node, runs torchrun's elastic agent over the worker module."""
