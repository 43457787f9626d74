"""Triton code generation for fused operators (docs/architecture.md, "Where the next features go").

Not implemented yet: the fusion pass is a later issue; nothing in autoshard calls into this package.
"""
