"""The programs the benchmark compares, all built from ONE single-device autoshard GPT (same weights).

- ``single_1t`` / ``single_nt``: the plain model in one process (rank 0 runs it, the other ranks wait),
  with 1 intra-op thread and with as many threads as there are ranks;
- ``megatron``: hand-written Megatron TP from Megatron-Core's own layers (``benchmarks/megatron_gpt.py``);
- ``dtensor``: PyTorch ``parallelize_module`` with a Colwise/Rowwise plan and ``loss_parallel``;
- ``autoshard``: ``autoshard.parallelize(..., loss_only=True)``;
- ``autoshard_inductor``: the same with ``codegen="inductor"`` (each rank's program through Inductor).

Each variant exposes ``step(idx, targets, tracer=None) -> loss`` (forward + backward), ``optimizer_step()``
(an AdamW step over the variant's own parameters: DTensors for DTensor and autoshard, plain tensors for
Megatron), ``zero_grad()``, ``loss_value(loss)`` and ``local_param_bytes()``.
"""
from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

VARIANTS = ("single_1t", "single_nt", "megatron", "dtensor", "autoshard", "autoshard_inductor")


def label(name: str, tp: int) -> str:
    return {"single_1t": "single process, 1 thread", "single_nt": f"single process, {tp} threads",
            "megatron": "Megatron-Core TP (hand-written)", "dtensor": "DTensor parallelize_module",
            "autoshard": "autoshard", "autoshard_inductor": "autoshard, codegen='inductor'"}[name]


class Unavailable(Exception):
    """A variant that cannot run here (a package is missing, a shape it cannot take): skipped, with why."""


class Variant:
    name = "?"
    rank0_only = False   # the single-process baselines run on rank 0 while the others wait

    def __init__(self, module: nn.Module):
        self.module = module
        self.opt = None

    def optimizer_step(self):
        if self.opt is None:
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4)
        self.opt.step()

    def forward_loss(self, idx, tgt):
        return self.module(idx, tgt)[1]

    def step(self, idx, tgt, tracer=None):
        if tracer is not None:
            tracer.phase = "fwd"
        loss = self.forward_loss(idx, tgt)
        if tracer is not None:
            tracer.phase = "bwd"
        loss.backward()
        return loss

    @staticmethod
    def loss_value(loss) -> float:
        return float(loss.detach())

    def zero_grad(self):
        for p in self.module.parameters():
            p.grad = None

    def local_param_bytes(self) -> int:
        total = 0
        for p in self.module.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            total += t.numel() * t.element_size()
        return total


# --- single process -----------------------------------------------------------------------------------
class Single(Variant):
    rank0_only = True

    def __init__(self, model, threads: int, name: str):
        super().__init__(copy.deepcopy(model))
        self.threads = threads
        self.name = name

    def step(self, idx, tgt, tracer=None):
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return super().step(idx, tgt, tracer)
        finally:
            torch.set_num_threads(before)


# --- Megatron-Core ------------------------------------------------------------------------------------
class Megatron(Variant):
    name = "megatron"

    def __init__(self, model, world: int, device):
        try:
            from benchmarks.megatron_gpt import build_megatron_gpt
        except ImportError as e:  # megatron-core not installed (it is in the `bench` extra)
            raise Unavailable(f"megatron-core is not importable ({e}); pip install megatron-core") from e
        super().__init__(build_megatron_gpt(model, world, device))


# --- DTensor parallelize_module -----------------------------------------------------------------------
def _local_heads_attention(self, x):
    """nanoGPT attention with the head count taken from the (local) width: q/k/v hold n_head/tp heads."""
    B, T, _ = x.size()
    hs = self.n_embd // self.n_head
    q = self.q_proj(x).view(B, T, -1, hs).transpose(1, 2)
    k = self.k_proj(x).view(B, T, -1, hs).transpose(1, 2)
    v = self.v_proj(x).view(B, T, -1, hs).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                       is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return self.resid_dropout(self.c_proj(y))


def unfuse_qkv(model):
    """The same model with separate q/k/v Linears (``fused_qkv=False``) and the same weights."""
    from autoshard.models import GPT

    cfg = copy.deepcopy(model.config)
    if not cfg.fused_qkv:
        return copy.deepcopy(model)
    cfg.fused_qkv = False
    out = GPT(cfg)
    sd = {}
    for k, v in model.state_dict().items():
        if ".attn.c_attn." in k:
            pre, leaf = k.split(".attn.c_attn.")
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.split(cfg.n_embd, dim=0)):
                sd[f"{pre}.attn.{name}.{leaf}"] = part.clone()
        else:
            sd[k] = v.clone()
    out.load_state_dict(sd)
    return out


class DTensorTP(Variant):
    """``parallelize_module`` with the plan of PyTorch's TP tutorial / torchtitan, plus ``loss_parallel``.

    DTensor's ColwiseParallel shards a Linear's output features contiguously, which would mix q, k and v
    of a fused ``c_attn``; like torchtitan, the model gets separate q/k/v projections (same weights) and
    an attention forward that takes its head count from the local width. The attention module's input is
    made a Replicate DTensor once (PrepareModuleInput), so the three projections' input gradients are
    summed as Partial and all-reduced once, as in Megatron's fused QKV.
    """
    name = "dtensor"

    def __init__(self, model, world: int, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       parallelize_module)

        m = unfuse_qkv(model).to(device)
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        tied = m.config.tie_weights
        plan = {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
        }
        for i, block in enumerate(m.transformer.h):
            block.attn.forward = types.MethodType(_local_heads_attention, block.attn)
            p = f"transformer.h.{i}"
            plan.update({
                f"{p}.attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                                use_local_output=False),
                f"{p}.attn.q_proj": ColwiseParallel(),
                f"{p}.attn.k_proj": ColwiseParallel(),
                f"{p}.attn.v_proj": ColwiseParallel(),
                f"{p}.attn.c_proj": RowwiseParallel(),
                f"{p}.mlp.c_fc": ColwiseParallel(),
                f"{p}.mlp.c_proj": RowwiseParallel(),
            })
        parallelize_module(m, mesh, plan)
        if tied:  # both are Shard(0) over the vocab: re-tie the two DTensor parameters
            m.lm_head.weight = m.transformer.wte.weight
        super().__init__(m)
        self.mesh = mesh

    def step(self, idx, tgt, tracer=None):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return super().step(idx, tgt, tracer)

    @staticmethod
    def loss_value(loss) -> float:
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


# --- autoshard ----------------------------------------------------------------------------------------
class Autoshard(Variant):
    name = "autoshard"

    def __init__(self, model, world: int, device, idx, tgt):
        import autoshard

        mesh = autoshard.init_mesh(tp=world)
        pm = autoshard.parallelize(copy.deepcopy(model).to(device), mesh, example_args=(idx, tgt), loss_only=True)
        super().__init__(pm)
        self.pm = pm


class AutoshardInductor(Variant):
    """autoshard with ``codegen="inductor"``. Its collectives are functional collectives inside the compiled
    graph, which ``pm.comm_counts()`` does not count (the plan's are ``pm.program.collectives``): it keeps
    its module as ``compiled_pm``, not ``pm``, so the benchmark's plan-vs-measured check leaves it out."""
    name = "autoshard_inductor"

    def __init__(self, model, world: int, device, idx, tgt):
        import autoshard

        mesh = autoshard.init_mesh(tp=world)
        pm = autoshard.parallelize(copy.deepcopy(model).to(device), mesh, example_args=(idx, tgt), loss_only=True,
                                   codegen="inductor")
        super().__init__(pm)
        self.compiled_pm = pm


def build(name, model, world, device, idx, tgt):
    if name == "single_1t":
        return Single(model.to(device), 1, name)
    if name == "single_nt":
        return Single(model.to(device), world, name)
    if name == "megatron":
        return Megatron(model, world, device)
    if name == "dtensor":
        return DTensorTP(model, world, device)
    if name == "autoshard":
        return Autoshard(model, world, device, idx, tgt)
    if name == "autoshard_inductor":
        return AutoshardInductor(model, world, device, idx, tgt)
    raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
