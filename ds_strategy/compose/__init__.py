"""Composition: the one function every adapter calls to turn a model into a trained-in-parallel one."""
