"""Triton code generation for fused operators (DESIGN.md pass 6).

Not implemented yet: the fuse pass is a later issue; nothing in autoshard
calls into this package today.
"""
