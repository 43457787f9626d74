"""The pipeline-parallel module: this rank's stages, their parameters and graphs, and ``step``.

``PipelineModule.step(*args, **kwargs)`` splits the batch into m microbatches and runs this rank's
actions through ``runtime/executor.py`` (``Run``: forwards, backwards and batched transfers).

The last stage's graph returns each microbatch's summed cross-entropy (``passes/microbatch_loss.py``);
its backward is seeded with ``1 / num_items``, the global batch's count of non-ignored targets (counted
per microbatch, summed over dp asynchronously: only the first backward waits for it), so the gradients
are the single-device model's on the whole batch, and so is the loss returned. A weight used on
two ranks' stages (a tied embedding and LM head) is held by both; their gradients are summed over the
ranks that hold it after the last backward (Megatron's embedding group), so the copies stay identical.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir.errors import InputError
from autoshard.ir.options import check_finite_enabled, dump_dir, pg_timeout_seconds
from autoshard.ir.pipeline import PipelineProgram
from autoshard.ir.schedule import Kind
from autoshard.ir.simulator import Timeline
from autoshard.runtime import training
from autoshard.runtime.batch_check import CHECKED_CALLS, check_same_batch, check_same_shapes_over_dp
from autoshard.runtime.bind import bind
from autoshard.runtime.comm import AxisComm
from autoshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradReducer
from autoshard.runtime.input_checks import check_dtype_kinds, check_inputs, naming_new_shapes
from autoshard.runtime.executor import Denominator, PipelineError, Run, split_batch
from autoshard.runtime.program_cache import ProgramCache, program_key
from autoshard.runtime.device import mesh_device, owned, owned_constant, to_device
from autoshard.runtime.params import ShardedParameters, model_buffers

log = logging.getLogger("autoshard")

__all__ = ["PipelineError", "PipelineModule", "split_batch"]


class PipelineModule(training.TrainingMethods, nn.Module):
    """This rank's stages of a pipelined model: its parameters, its stages' graphs, and ``step``.

    ``peers[i]`` is the global rank of pipeline rank i in this rank's pp group; ``tie_groups`` maps a
    parameter held by several pp ranks to the process group of those ranks (``None``: no ties here).
    A ``ParallelModule`` running its ``step`` through this executor passes its own ``params`` and
    ``buffer_source`` (name -> its buffer, read at every step, so state loads and ``.to()`` reach the
    step) instead of the model.
    """

    def __init__(self, program: PipelineProgram, model: nn.Module | None, comms: dict | None = None, tp_mesh=None,
                 peers: list | None = None, tie_groups: dict | None = None, params: ShardedParameters | None = None,
                 buffer_source=None, device: torch.device | None = None, p2p_groups: dict | None = None):
        super().__init__()
        coords = program.mesh.coords(program.rank)
        self.device = device if device is not None else mesh_device(tp_mesh)   # runtime/device.py
        self.program = program
        self.comms = comms if comms is not None else {
            a: AxisComm(a, program.mesh.axis_size(a), coords[a]) for a in coords}
        # ``params``: a ParallelModule's own shards, when its ``step`` runs through this executor (pp = 1)
        self.params = params if params is not None else ShardedParameters(program.params, model, self.comms["tp"],
                                                                           tp_mesh)
        self.aliases = dict(program.captured.aliases)
        self.peers = peers or [program.rank]
        self.tie_groups = dict(tie_groups or {})
        self.p2p_groups = dict(p2p_groups or {})   # (src, dst) pp ranks -> the group of that direction's transfers
        ties = program.ties()
        # a tied weight is counted once in the gradient norm: by the lowest pp rank holding it
        self.duplicate_params = {n for n, ranks in ties.items() if ranks[0] != program.pp_rank}
        self.timeout = datetime.timedelta(seconds=pg_timeout_seconds())
        self._persistent = set(model.state_dict().keys()) if model is not None else set()
        buffers = model_buffers(model, self._persistent) if model is not None else {}   # meta ones rebuilt
        self._buffer_source = buffer_source
        self._buffers_by_name, self._buffer_names = {}, []   # buffer name -> attribute b0, b1, ... (and in order)
        for c in program.own:
            for i in c.inputs:
                if i.kind == "buffer" and i.name in buffers and i.name not in self._buffers_by_name:
                    attr = f"b{len(self._buffers_by_name)}"
                    self.register_buffer(attr, owned(buffers[i.name], self.device),
                                         persistent=i.name in self._persistent)
                    self._buffers_by_name[i.name] = attr
                    self._buffer_names.append(i.name)
        # the constants export lifted (torch.tensor(...) in the forward) that this rank's stages read, and not
        # as one of the model's buffers: numbered per trace, so each program owns its own
        constants = program.captured.constants
        self._constants = {i.name: owned_constant(constants[i.name], i.name, self.device) for c in program.own
                           for i in c.inputs if i.kind == "buffer" and i.name in constants
                           and i.name not in self._buffers_by_name}
        self.graphs = nn.ModuleDict({str(c.index): bind(c.gm, self.comms, self.device, program.options.codegen)
                                     for c in program.own})
        self._recorded = None                # the last step's action marks (Recorded); read by last_timeline
        self._timeline = None                # ... and the Timeline made of them, once read
        out = dump_dir(program.options.dump)
        self._dump = (out if program.rank == 0 else f"{out}/rank{program.rank}") if out else None
        self._steps = 0
        self._dp_reducer = None              # the last step's dp reducer (last_dp_wait reads its wait)
        self.zero = getattr(program.options.pipeline, "zero", 0)
        self.bucket_bytes = DEFAULT_BUCKET_BYTES   # dp gradient buckets (DDP's bucket_cap_mb)
        self.first_bucket_bytes = None             # None: 1 MiB on CUDA, as the others on CPU (data_parallel.py)
        self.post_receives_early = None      # every receive posted at the step's start: None = on gloo only
        self.max_programs = 8                # twins kept (other batch shapes, eval mode): parallelize(max_programs=)
        self._batch_checks = 0               # calls whose batch was checked to be the same on tp and pp ranks
        # count the bytes each microbatch's forward saves for backward (a saved_tensors_hooks callback per
        # saved tensor, a few percent of a step on CPU): on when dumping, or set it for a benchmark
        self.measure_memory = self._dump is not None
        self.train(True)
        if model is not None:
            training.check_same_weights(model, "parallelize", program.mesh.size)   # stages, replicas, tied copies
        # state_dict() with the model's own names, as ParallelModule's (this rank's stages only)
        training.register_state_dict_names(self)

    def forward(self, *args, **kwargs):
        raise TypeError("a pipelined model runs whole batches: call pm.step(*batch) (forward and backward over the "
                        "microbatches, returning the loss) or pm.eval_batch(*batch) (the eval-mode loss, no "
                        "gradients); pm(...) runs a forward only for pp=1")

    # --- the step -----------------------------------------------------------------------------------------
    @property
    def schedule(self):
        return self.program.schedule

    def _value(self, inp, user: dict):
        if inp.kind == "buffer":
            if inp.name in self._buffers_by_name:
                return getattr(self, self._buffers_by_name[inp.name])
            if inp.name in self._constants or self._buffer_source is None:
                return self._constants[inp.name]
            return self._buffer_source(inp.name)
        return user[inp.name]

    def _inputs(self, chunk, boundary, user, params: list) -> list:
        params = iter(params)
        out = []
        for inp in chunk.inputs:
            if inp.kind == "boundary":
                out.append(boundary)
            elif inp.kind == "parameter":
                out.append(next(params))
            else:
                out.append(self._value(inp, user))
        return out

    def _step_state(self, grads_held: bool):
        """``(leaves, reducer)`` for a step: the parameters' local leaves (made once, remade only if a shard
        was replaced) with no gradient yet, and the dp reducer built on them (None without dp)."""
        cached = self.__dict__.get("_leaves_cache")
        if cached is None or not self.params.leaves_current(cached[0]):
            if cached is not None and cached[1] is not None:
                cached[1].close()
            leaves = self.params.step_leaves(list(self.params.records))
            dp = self.comms["dp"]
            reducer = GradReducer(dp, leaves, {c.index: c.param_names for c in self.program.own},
                                  self.bucket_bytes, self.first_bucket_bytes) if dp.size > 1 else None
            cached = self.__dict__["_leaves_cache"] = (leaves, reducer)
        leaves, reducer = cached
        if reducer is None:
            for leaf in leaves.values():
                leaf.grad = None
        else:
            reducer.begin_step(grads_still_held=grads_held)
        return leaves, reducer

    def _denominator(self, micro_users: list, device=None) -> "Denominator | None":
        """What the loss is divided by: the non-ignored targets of every microbatch of every dp rank (an
        all-reduce over dp, started now and waited for at the first backward), or the number of
        microbatches for the mean-of-means fallback. Only ranks holding the last stage need it."""
        if self.program.chunks[-1].index not in self.schedule.stages_of(self.program.pp_rank):
            return None
        loss, dp = self.program.loss, self.comms["dp"]
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

    def _microbatches(self, args, kwargs, what: str) -> list:
        """The user inputs of each microbatch (name -> value), checked against the compiled shapes."""
        captured = self.program.captured
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise InputError(f"{what} got inputs of structure {spec}, but the pipeline was compiled for "
                            f"{captured.in_spec}: pass the same arguments (by the same keywords) as the example")
        if self._batch_checks < CHECKED_CALLS:      # tp and pp ranks given one batch (a data-loader slip)
            self._batch_checks += 1
            check_same_batch(self.comms, leaves, what)
            if what == "pm.step":                   # and the replicas' training batches one shape
                check_same_shapes_over_dp(self.comms, leaves, what)
        check_inputs(captured.index_ranges, dict(zip(captured.user_input_names, (leaves[i] for i in captured.input_leaves))))
        micro = split_batch(leaves, self.schedule.microbatches, captured.example_leaves)
        return [dict(zip(captured.user_input_names, (mb[i] for i in captured.input_leaves))) for mb in micro]

    def _global_loss(self, run) -> torch.Tensor:
        loss = run.loss.reshape(1).clone()
        for axis in ("pp", "dp"):              # the last stage's share, summed over stages and replicas
            if self.comms[axis].size > 1:
                loss = self.comms[axis].all_reduce(loss, "loss")
        return loss[0]

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the whole batch over the pipeline: returns the loss (on every rank)
        and leaves each local shard's gradient in ``.grad`` (accumulated, as ``backward`` does)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("pm.step runs forward and backward over the pipeline and cannot run under "
                               "torch.no_grad(); for a validation loss call pm.eval_batch(*batch) (eval mode, "
                               "no gradients)")
        args, kwargs = to_device((args, kwargs), self.device)
        # after pm.eval(), as after model.eval() in torch: forward and backward without dropout
        twin = self._twin(args, kwargs, training=self.training)
        if twin is not self:        # eval mode, or another batch shape (an epoch's short last batch): its own program
            return twin.step(*args, **kwargs)
        users = self._microbatches(args, kwargs, "pm.step")
        grads_held = any(p.grad is not None for p in self.params._stored.values())   # before the tied stash
        saved_tied = self._stash_tied_grads()
        try:
            run = Run(self, users, grads_held)
            run.execute(self.schedule.actions.get(self.program.pp_rank, []))
        except BaseException:      # the earlier gradients of tied weights are the caller's: put them back
            for name, p, _ in self._tied():
                p.grad = saved_tied.get(name)
            raise
        if run.reducer is not None:
            run.reducer.finish()                 # the dp sums, overlapped with the last backward
            self._dp_reducer = run.reducer
        self.params.accumulate_step_grads(run.leaves)
        self._sum_tied_grads(saved_tied)       # after the dp sum: both are complete sums, in either order
        loss = self._global_loss(run)
        if check_finite_enabled(self.program.options.check_finite):
            training.check_finite(self, loss, self._steps + 1, grads=True)
        self._recorded, self._timeline = run.recorded(), None   # times only when asked: on a GPU that waits
        self._steps += 1
        if self._dump and self._steps <= 2:   # the first step warms up; the second is drawn over it
            self._dump_measured()
        return loss

    def eval_batch(self, *args, **kwargs) -> torch.Tensor:
        """The loss of a batch in eval mode (no dropout), forward only, on every rank: the same inputs and
        loss as ``step`` (the global batch's, over microbatches and dp), no gradients and no activations
        kept. The eval program is compiled on first use (per batch shape), on the training program's
        stage cuts and placements, so it runs on the same parameter shards."""
        args, kwargs = to_device((args, kwargs), self.device)
        twin = self._twin(args, kwargs, training=False)
        users = twin._microbatches(args, kwargs, "pm.eval_batch")
        with torch.no_grad():
            run = Run(twin, users, grads_held=False, forward_only=True)
            run.execute([a for a in twin.schedule.actions.get(twin.program.pp_rank, [])
                         if a.kind in (Kind.F, Kind.SEND_F, Kind.RECV_F)])
            return twin._global_loss(run)

    def _compiled_for(self, args, kwargs) -> bool:
        """Whether a batch has the shapes this module's program was compiled for."""
        captured = self.program.captured
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            return False
        try:
            split_batch(leaves, self.schedule.microbatches, captured.example_leaves)
        except ValueError:
            return False
        return True

    def _twin(self, args, kwargs, training: bool) -> "PipelineModule":
        """This module, or a twin running another program (eval mode, or another batch shape: an epoch's
        short last batch) on the same parameter shards, compiled on first use on this program's cuts."""
        if self.__dict__.get("_twin_of") is not None or (training and self._compiled_for(args, kwargs)):
            return self
        key = program_key(training, *pytree.tree_flatten((args, kwargs)))
        if "_twins" not in self.__dict__:
            self.__dict__["_twins"] = ProgramCache(lambda: self.max_programs, "pipeline program",
                                                   on_drop=lambda t: t.close())
        twins = self.__dict__["_twins"]
        twin = twins.get(key)
        if twin is None:
            check_dtype_kinds(pytree.tree_leaves((args, kwargs)), self.program.captured)   # before compiling
            compiler = getattr(self, "_twin_compiler", None)
            if compiler is None:
                raise RuntimeError("another batch shape or eval mode needs the compiler: build the module with "
                                   "autoshard.parallelize")
            start = time.perf_counter()
            with naming_new_shapes(pytree.tree_leaves((args, kwargs)), self.program.captured,
                                   self.schedule.microbatches):
                program = compiler(self.program, args, kwargs, training)
            mine = {c.index: c.param_names for c in self.program.own}
            if {c.index: c.param_names for c in program.own} != mine:
                raise RuntimeError(f"the {'training' if training else 'eval'}-mode program for these inputs puts "
                                   "other parameters on this rank's stages than the first program: evaluate the "
                                   "single-device model on pm.full_state_dict()")
            twin = PipelineModule(program, None, self.comms, peers=self.peers, tie_groups=self.tie_groups,
                                  params=self.params, buffer_source=self._train_buffer, device=self.device,
                                  p2p_groups=self.p2p_groups)
            twin.train(training)
            twin.bucket_bytes, twin.post_receives_early = self.bucket_bytes, self.post_receives_early
            twin.first_bucket_bytes = self.first_bucket_bytes
            twin.max_programs = self.max_programs
            twin.__dict__["_twin_of"] = self
            twins.put(key, twin)
            log.info("autoshard: compiled a %s pipeline program for inputs %s in %.2f s",
                     "training" if training else "eval", key.inputs, time.perf_counter() - start)
        return twin

    def _train_buffer(self, name):
        if name in self._buffers_by_name:
            return getattr(self, self._buffers_by_name[name])
        if self._buffer_source is not None:
            return self._buffer_source(name)
        raise RuntimeError(f"a program for other inputs or eval mode reads buffer '{name}', which this rank's "
                           "training stages do not hold: evaluate the single-device model on pm.full_state_dict()")

    def _dump_measured(self) -> None:
        """The measured timeline (``measured.svg``, ``measured.md``) beside the simulated one in
        ``pipeline.md``: every pp rank takes part in gathering it; each writes to its own dump directory."""
        tl, out = self.measured_timeline(), self._dump
        sched = self.schedule
        tl.to_svg(os.path.join(out, "measured.svg"))
        ideal = (sched.pp - 1) / (sched.virtual * sched.microbatches)
        with open(os.path.join(out, "measured.md"), "w") as f:
            f.write(f"Measured (step {self._steps}{', with warm-up' if self._steps == 1 else ''}): step {tl.step_time * 1e3:.1f} ms, bubble "
                    f"{tl.bubble_over_ideal:.3f} of the busy time (closed form {ideal:.3f}); per rank busy "
                    + ", ".join(f"{r}: {b * 1e3:.1f} ms" for r, b in tl.busy.items())
                    + "; peak saved activations " + ", ".join(f"{r}: {b / 2**20:.2f} MiB"
                                                             for r, b in tl.peak_activation_bytes.items()) + "\n")

    # --- tied weights ---------------------------------------------------------------------------------------
    def _held_buffers(self) -> dict:
        return {name: getattr(self, attr) for name, attr in self._buffers_by_name.items()}

    def close(self) -> None:
        """Remove the dp reducer's gradient hooks from the step's leaves (an executor no longer used)."""
        cached = self.__dict__.pop("_leaves_cache", None)
        if cached is not None and cached[1] is not None:
            cached[1].close()

    def _tied(self):
        """The tied weights this rank holds a copy of, with their pp group (frozen ones have no gradient)."""
        for name, group in self.tie_groups.items():
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

    # --- state -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-device state dict (original names, full shapes), on every rank: each pp rank gathers
        its stages over tp, then the stages are exchanged over pp."""
        # on the CPU: all_gather_object pickles, and a CUDA tensor would unpickle on its sender's device
        mine = {name: self.gather(name, p.detach()).cpu().clone() for name, p in self.local_parameters().items()}
        for name, attr in self._buffers_by_name.items():
            if name in self._persistent:
                mine[name] = getattr(self, attr).cpu().clone()
        parts = self.comms["pp"].all_gather_objects(mine)
        out = {}
        for part in parts:
            out.update(part)
        for alias, main in self.aliases.items():
            if main in out:
                out[alias] = out[main]
        return out

    @property
    def last_dp_wait(self) -> float:
        """Seconds the last step's end waited for its dp all-reduces (what backward did not hide)."""
        return self._dp_reducer.waited_seconds() if self._dp_reducer is not None else 0.0

    @property
    def last_timeline(self) -> Timeline | None:
        """This rank's timeline of the last ``step``: when each of its actions ran, from the clock that saw
        it run (CUDA events on a GPU, so reading it waits for that step's work)."""
        if self._timeline is None and self._recorded is not None:
            self._timeline = self._recorded.timeline()
        return self._timeline

    def measured_timeline(self) -> Timeline:
        """The last step's timeline over every pp rank (a collective over pp): what the dump draws."""
        parts = self.comms["pp"].all_gather_objects(self.last_timeline)
        spans = {r: t.spans[r] for r, t in enumerate(parts)}
        busy = {r: t.busy[r] for r, t in enumerate(parts)}
        peak = {r: t.peak_activation_bytes.get(r, 0) for r, t in enumerate(parts)}
        return Timeline(f"{self.schedule.name} (measured)", self.schedule.pp, spans,
                        max(t.step_time for t in parts), busy, peak)
