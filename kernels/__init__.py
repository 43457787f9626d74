"""Triton code generation for fusion groups (the ``fuse`` pass, ``passes/fusion.py``).

- ``optable``: the primitive ATen ops the generator knows, each as a Triton expression;
- ``trace``: a group and its vector-Jacobian product traced down to those ops (``make_fx``);
- ``indexing``: operand offsets in the ``[rows, cols]`` iteration space (sympy);
- ``lower``: a primitive graph to a ``KernelPlan`` (data);
- ``codegen``: the pointwise and row-reduction templates that render a plan as source;
- ``cache``: the source written to a cache folder and imported;
- ``launch``: launchers, the ``autograd.Function`` and the ``FusedGroup`` module the graph calls.

Nothing here imports triton until a kernel is generated, so autoshard imports without it.
"""
