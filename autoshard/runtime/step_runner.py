"""``StepRunner``: one compiled step program of a ``ParallelModule``, and ``step`` / ``eval_batch`` over it.

A step program is a ``PipelineProgram``: this rank's stages of the model, a schedule of actions and the
loss's divisor. pp = 1 is a one-stage pipeline, so ``pm.step`` runs through a runner on every mesh. The
runner holds what is specific to its program (the bound stage graphs, the constants export lifted, the
step's local leaves and dp reducer, the last timeline) and nothing else: the parameters, buffers and
settings are the module's (``runtime/module.py``), read at every step, so a loaded state dict, a changed
``pm.bucket_bytes`` or ``pm.measure_memory`` reach every runner. ``runtime/executor.py`` (``Run``) walks
the schedule through the narrow interface below (``graph``, ``stage_inputs``, ``step_leaves``,
``denominator`` and the transfer settings), as torch's ``schedules.py`` talks only to ``stage.py``.

The last stage's graph returns each microbatch's summed cross-entropy (``passes/microbatch_loss.py``);
its backward is seeded with ``1 / num_items``, the global batch's count of non-ignored targets (counted
per microbatch, summed over dp asynchronously: only the first backward waits for it), so the gradients
are the single-device model's on the whole batch, and so is the loss returned. A weight used on two
ranks' stages (a tied embedding and LM head) is held by both; their gradients are summed over the ranks
that hold it after the last backward (Megatron's embedding group), so the copies stay identical.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir.errors import InputError
from autoshard.ir.options import check_finite_enabled, dump_dir
from autoshard.ir.pipeline import PipelineProgram
from autoshard.ir.schedule import Kind
from autoshard.ir.partial_grads import TP_PARTIAL_GRADS, sum_over_tp
from autoshard.ir.weight_grad import WEIGHT_GRAD_PLAN
from autoshard.ir.simulator import Timeline
from autoshard.runtime import training
from autoshard.runtime.batch_check import CHECKED_CALLS, check_same_batch
from autoshard.runtime.bind import bind
from autoshard.runtime.data_parallel import GradReducer
from autoshard.runtime.executor import Denominator, Run
from autoshard.runtime.input_checks import check_call_inputs
from autoshard.runtime.stage_rng import draws_random, stage_stream
from autoshard.runtime.microbatch import split_batch


class StepRunner:
    """Runs ``program`` (this rank's stages) for ``module``: its forwards, backwards and transfers."""

    def __init__(self, module, program: PipelineProgram, training_mode: bool = True):
        self.module, self.program, self.training_mode = module, program, training_mode
        # each buffer these stages read: one of the model's (registered on the module, shared by every
        # program), or a constant export lifted (torch.tensor(...) in the forward), numbered per trace, so
        # each program owns its own
        self.constants = {}
        for c in program.own:
            for i in c.inputs:
                if i.kind == "buffer" and i.name not in self.constants and module.buffer(i.name) is None:
                    self.constants[i.name] = module.program_constant(program, i.name)
        opts = program.options
        self.graphs = nn.ModuleDict({str(c.index): bind(c.gm, module.comms, module.device, opts.codegen, opts.cuda_graphs)
                                     for c in program.own})
        out = dump_dir(program.options.dump)
        self.dump = (out if program.rank == 0 else f"{out}/rank{program.rank}") if out else None
        self.steps = 0
        self.recorded = None                 # the last step's action marks (Recorded); read by last_timeline
        self._timeline = None                # ... and the Timeline made of them, once read
        self.dp_reducer = None               # the last step's dp reducer (last_dp_wait reads its wait)
        self._leaves = None                  # (the step's local leaves, their dp reducer), remade on a new shard
        self._batch_checks = 0               # calls whose batch was checked to be the same on tp and pp ranks
        # any stage draws random numbers (dropout): each pp rank then steps on a stream of its own
        self.draws_random = draws_random(c.gm for c in program.chunks)

    # --- the stage interface Run walks the schedule through --------------------------------------------
    @property
    def schedule(self):
        return self.program.schedule

    @property
    def params(self):
        return self.module.params

    @property
    def peers(self) -> list:
        return self.module.peers

    @property
    def p2p_groups(self) -> dict:
        return self.module.p2p_groups

    @property
    def timeout(self):
        return self.module.timeout

    @property
    def post_receives_early(self):
        return self.module.post_receives_early

    @property
    def measure_memory(self) -> bool:
        return self.module.measure_memory

    def graph(self, stage: int):
        return self.graphs[str(stage)]

    def stage_inputs(self, chunk, boundary, user: dict, params: list) -> list:
        """A stage graph's inputs, in its order: the boundary, parameters, buffers and user inputs."""
        params = iter(params)
        out = []
        for inp in chunk.inputs:
            if inp.kind == "boundary":
                out.append(boundary)
            elif inp.kind == "parameter":
                out.append(next(params))
            elif inp.kind == "buffer":
                out.append(self.constants[inp.name] if inp.name in self.constants else self.module.buffer(inp.name))
            else:
                out.append(user[inp.name])
        return out

    def step_leaves(self, grads_held: bool):
        """``(leaves, reducer)`` for a step: the parameters' local leaves (made once, remade only if a shard
        was replaced) with no gradient yet, and the dp reducer built on them (None without dp)."""
        if self._leaves is None or not self.params.leaves_current(self._leaves[0]):
            self.close()
            leaves = self.params.step_leaves(list(self.params.records))
            dp = self.module.comms["dp"]
            split = getattr(self.program, "gm", None) is not None and self.program.gm.meta.get(WEIGHT_GRAD_PLAN)
            late = split.late if split else frozenset()     # the gradients a zero-bubble W computes
            reducer = GradReducer(dp, leaves, {c.index: c.param_names for c in self.program.own},
                                  self.module.bucket_bytes, self.module.first_bucket_bytes,
                                  late=late) if dp.size > 1 else None
            self._leaves = (leaves, reducer)
        leaves, reducer = self._leaves
        if reducer is None:
            # under CUDA graphs a backward's outputs live in memory the next replay overwrites: a leaf whose
            # .grad is None would take the first microbatch's output as its gradient and lose it to the
            # second. A zeroed gradient makes autograd add into it instead (the reducer's buckets do so too)
            graphs = self.program.options.cuda_graphs
            read = {n for c in self.program.own for n in c.param_names} if graphs else ()   # not an unread one
            for name, leaf in leaves.items():
                leaf.grad = torch.zeros_like(leaf) if graphs and leaf.requires_grad and name in read else None
        else:
            reducer.begin_step(grads_still_held=grads_held)
        return leaves, reducer

    def denominator(self, micro_users: list, device=None) -> "Denominator | None":
        """What the loss is divided by: the non-ignored targets of every microbatch of every dp rank (an
        all-reduce over dp, started now and waited for at the first backward), or the number of
        microbatches for the mean-of-means fallback. Only ranks holding the last stage need it."""
        if self.program.chunks[-1].index not in self.schedule.stages_of(self.program.pp_rank):
            return None
        loss, dp = self.program.loss, self.module.comms["dp"]
        pieces = float(len(micro_users) * dp.size)
        if not loss.exact:
            return Denominator(torch.tensor(pieces, device=device))
        if loss.count is None and loss.scale_input is None:   # a summed loss: the microbatches' sums add up
            return Denominator(torch.tensor(1.0, device=device))
        if loss.count is None:     # a sum over one shared divisor plus other terms: the first one summed
            for u in micro_users:
                u[loss.scale_input] = torch.tensor(pieces, dtype=torch.float32, device=device)
            return Denominator(torch.tensor(pieces, device=device))
        total = torch.as_tensor(sum(loss.count(*[u[n] for n in loss.count_inputs]) for u in micro_users),
                                dtype=torch.float32, device=device).reshape(1).clone()
        counted = Denominator(total, dp.all_reduce_async(total, "count") if dp.size > 1 else None)
        if loss.scale_input is None:
            return counted
        # a loss of several terms: its cross-entropy is scaled in the graph, so the first forward waits
        for u in micro_users:
            u[loss.scale_input] = (pieces / counted.value()).to(torch.float32)
        return Denominator(torch.tensor(pieces, device=device))

    # --- a call ---------------------------------------------------------------------------------------
    def compiled_for(self, args, kwargs) -> bool:
        """Whether a batch has the shapes this program was compiled for."""
        captured = self.program.captured
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            return False
        try:
            split_batch(leaves, self.schedule.microbatches, captured.example_leaves)
        except ValueError:
            return False
        return True

    def microbatches(self, args, kwargs, what: str) -> list:
        """The user inputs of each microbatch (name -> value), checked against the compiled shapes."""
        captured = self.program.captured
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise InputError(f"{what} got inputs of structure {spec}, but the pipeline was compiled for "
                             f"{captured.in_spec}: pass the same arguments (by the same keywords) as the example")
        comms = self.module.comms
        if self._batch_checks < CHECKED_CALLS:      # tp and pp ranks given one batch (a data-loader slip)
            self._batch_checks += 1
            check_same_batch(comms, leaves, what)

        check_call_inputs(captured, leaves)
        micro = split_batch(leaves, self.schedule.microbatches, captured.example_leaves, (args, kwargs))
        return [dict(zip(captured.user_input_names, (mb[i] for i in captured.input_leaves))) for mb in micro]

    def _global_loss(self, run) -> torch.Tensor:
        loss = run.loss.reshape(1).clone()
        for axis in ("pp", "dp"):              # the last stage's share, summed over stages and replicas
            comm = self.module.comms[axis]
            if comm.size > 1:
                loss = comm.all_reduce(loss, "loss")
        return loss[0]

    def step(self, args, kwargs) -> torch.Tensor:
        """Forward and backward of the whole batch: the loss (on every rank), and each local shard's
        gradient accumulated in ``.grad``, as ``backward`` does."""
        users = self.microbatches(args, kwargs, "pm.step")
        params = self.params
        grads_held = any(p.grad is not None for p in params._stored.values())   # before the tied stash
        saved_tied = self._stash_tied_grads()
        try:
            run = Run(self, users, grads_held)
            pp = self.module.comms["pp"]
            with stage_stream(pp.size, pp.rank, self.draws_random, self.module.device):
                run.execute(self.schedule.actions.get(self.program.pp_rank, []))
        except BaseException:      # the earlier gradients of tied weights are the caller's: put them back
            for name, p, _ in self._tied():
                p.grad = saved_tied.get(name)
            raise
        if run.reducer is not None:
            run.reducer.finish()                 # the dp sums, overlapped with the last backward
            self.dp_reducer = run.reducer
        self._sum_partial_grads(run.leaves)    # after the dp sum: sums over dp and tp commute
        params.accumulate_step_grads(run.leaves)
        self._sum_tied_grads(saved_tied)       # after the dp sum: both are complete sums, in either order
        loss = self._global_loss(run)
        if check_finite_enabled(self.program.options.check_finite):
            training.check_finite(self.module, loss, self.steps + 1, grads=True)
        self.recorded, self._timeline = run.recorded(), None   # times only when asked: on a GPU that waits
        self.steps += 1
        if self.dump and self.steps <= 2:   # the first step warms up; the second is drawn over it
            self._dump_measured()
        return loss

    def eval_batch(self, args, kwargs) -> torch.Tensor:
        """The batch's loss, forwards only: nothing kept for a backward, no gradients."""
        users = self.microbatches(args, kwargs, "pm.eval_batch")
        with torch.no_grad():
            run = Run(self, users, grads_held=False, forward_only=True)
            run.execute([a for a in self.schedule.actions.get(self.program.pp_rank, [])
                         if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)])
            return self._global_loss(run)

    def close(self) -> None:
        """Remove the dp reducer's gradient hooks from the step's leaves (a runner no longer used)."""
        if self._leaves is not None and self._leaves[1] is not None:
            self._leaves[1].close()
        self._leaves = None

    def _sum_partial_grads(self, leaves: dict) -> None:
        """The gradients each tp rank computed only its share of (``ir/partial_grads``), summed over tp in
        one call: this step's alone, since the leaves start every step without one."""
        partial = getattr(self.program, "gm", None) is not None and self.program.gm.meta.get(TP_PARTIAL_GRADS)
        if partial:
            names = [n for n in partial.names if n in leaves and leaves[n].grad is not None]
            for n, g in zip(names, sum_over_tp(self.module.comms["tp"], [leaves[n].grad for n in names])):
                leaves[n].grad = g

    # --- tied weights ---------------------------------------------------------------------------------
    def _tied(self):
        """The tied weights this rank holds a copy of, with their pp group (frozen ones have no gradient)."""
        for name, group in self.module.tie_groups.items():
            p = self.params.param(name)
            if p.requires_grad:
                yield name, p, group

    def _stash_tied_grads(self) -> dict:
        """Earlier gradients of tied weights (identical on their ranks): kept aside so that only this step's
        gradients are summed between the copies."""
        saved = {}
        for name, p, _ in self._tied():
            saved[name], p.grad = p.grad, None
        return saved

    @torch.no_grad()
    def _sum_tied_grads(self, saved: dict) -> None:
        for name, p, group in self._tied():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=group)
            if saved[name] is not None:
                p.grad += saved[name]

    # --- timelines ------------------------------------------------------------------------------------
    @property
    def last_timeline(self) -> Timeline | None:
        if self._timeline is None and self.recorded is not None:
            self._timeline = self.recorded.timeline()
        return self._timeline

    def measured_timeline(self) -> Timeline:
        """The last step's timeline over every pp rank (a collective over pp): what the dump draws."""
        parts = self.module.comms["pp"].all_gather_objects(self.last_timeline)
        spans = {r: t.spans[r] for r, t in enumerate(parts)}
        busy = {r: t.busy[r] for r, t in enumerate(parts)}
        peak = {r: t.peak_activation_bytes.get(r, 0) for r, t in enumerate(parts)}
        return Timeline(f"{self.schedule.name} (measured)", self.schedule.pp, spans,
                        max(t.step_time for t in parts), busy, peak)

    def _dump_measured(self) -> None:
        """The measured timeline (``measured.svg``, ``measured.md``) beside the simulated one in
        ``pipeline.md``: every pp rank takes part in gathering it; each writes to its own dump directory."""
        tl, out, sched = self.measured_timeline(), self.dump, self.schedule
        tl.to_svg(os.path.join(out, "measured.svg"))
        ideal = (sched.pp - 1) / (sched.virtual * sched.microbatches)
        form = "1F1B's (p-1)/(v m), which a split schedule undercuts" if sched.split else "closed form"
        with open(os.path.join(out, "measured.md"), "w") as f:
            f.write(f"Measured (step {self.steps}{', with warm-up' if self.steps == 1 else ''}): step "
                    f"{tl.step_time * 1e3:.1f} ms, bubble {tl.bubble_over_ideal:.3f} of the busy time ({form} "
                    f"{ideal:.3f}); per rank busy " + ", ".join(f"{r}: {b * 1e3:.1f} ms" for r, b in tl.busy.items())
                    + "; peak saved activations " + ", ".join(f"{r}: {b / 2**20:.2f} MiB"
                                                             for r, b in tl.peak_activation_bytes.items()) + "\n")
