"""``ParallelModule``: the one ``nn.Module`` a user holds, on every mesh.

It keeps what is this rank's and lives as long as training does: the parameter shards
(``ShardedParameters``), the model's buffers (registered as ``b0``, ``b1``, ... the first time a program
reads one), the state dicts under the model's own names, and the settings a loop may change
(``bucket_bytes``, ``max_programs``, ``measure_memory``, ...). What runs is in the runners, which read
all of that from here (``bucket_bytes`` when a runner first builds its dp reducer, the rest at every
call):

- ``ForwardRunner`` (``forward_runner.py``): ``pm(...)``'s forward programs (pp = 1), a bounded cache
  of one per call shape and mode;
- ``StepRunner`` (``step_runner.py``): ``pm.step`` and ``pm.eval_batch``, one per step program (a
  pipeline of one stage or more), also cached per batch shape and mode.

The compilers are passed in at construction (``api.parallelize`` hands them in; the runtime never imports
the compiler): ``compiler(args, kwargs, training, pins) -> Program`` for a new forward call, and
``step_compiler(args, kwargs, training) -> PipelineProgram`` for a new batch shape or mode of ``step``.
"""
from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autoshard.ir.options import check_finite_enabled, check_replicas_every, dump_dir, pg_timeout_seconds, uses_nccl
from autoshard.ir.pipeline import PipelineProgram
from autoshard.ir.program import Program
from autoshard.runtime import training
from autoshard.runtime.comm import AxisComm
from autoshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES
from autoshard.runtime.device import mesh_device, owned, owned_constant, to_device
from autoshard.runtime.batch_check import CHECKED_CALLS, check_same_shapes_over_dp
from autoshard.runtime.forward_runner import ForwardRunner, warn_constant_inputs
from autoshard.ir.errors import InputError
from autoshard.runtime.input_checks import check_call_inputs, check_dtype_kinds, in_example_order, naming_new_shapes
from autoshard.runtime.params import ShardedParameters, model_buffers
from autoshard.runtime.program_cache import ProgramCache, program_key
from autoshard.runtime.step_runner import StepRunner

log = logging.getLogger("autoshard")


class ParallelModule(training.TrainingMethods, nn.Module):
    """This rank's shards of a parallelized model, run by its compiled programs (any torch optimizer).

    ``program`` is the first compiled: a ``Program`` (pp = 1: ``forward`` takes the model's inputs and
    returns its outputs) or a ``PipelineProgram`` (this rank's stages: train with ``step``; at pp = 1, where
    ``parallelize`` starts from the step program at dp > 1, ``forward`` compiles its programs on first
    use). ``comms``
    maps each mesh axis to this rank's ``AxisComm`` (``None``: single-rank communicators); ``tp_mesh`` (a
    1-D DeviceMesh) makes the parameters DTensors. ``peers[i]`` is the global rank of pipeline rank i;
    ``tie_groups`` maps a weight held on several pp ranks to their process group; ``p2p_groups`` maps
    (src, dst) pp ranks to the group of that direction's transfers.
    """

    def __init__(self, program: Program | PipelineProgram, model: nn.Module, comms: dict | None = None,
                 tp_mesh=None, *, compiler=None, step_compiler=None, max_programs: int = 8,
                 peers: list | None = None, tie_groups: dict | None = None, p2p_groups: dict | None = None):
        super().__init__()
        coords = program.coords
        self.comms = comms if comms is not None else {
            a: AxisComm(a, program.mesh.axis_size(a), coords[a]) for a in coords}
        for a, c in self.comms.items():
            if (c.size, c.rank) != (program.mesh.axis_size(a), coords[a]):
                raise ValueError(f"communicator for axis '{a}' is rank {c.rank} of {c.size}, but the program was "
                                 f"compiled for rank {coords[a]} of {program.mesh.axis_size(a)}")
        self.params = ShardedParameters(program.params, model, self.comms["tp"], tp_mesh)
        self.aliases = dict(program.captured.aliases)
        self.device = mesh_device(tp_mesh)              # where this rank computes (runtime/device.py)
        _check_cuda_graphs(program, self.device or next((p.device for p in self.params.parameters()), None))
        self._persistent = set(model.state_dict().keys())
        self._model_buffers = model_buffers(model, self._persistent)   # a buffer on meta rebuilt, as the model would
        self._buffer_names = []              # the model's buffers, registered as b0, b1, ... (names may hold "__")
        self._buffer_attr = {}               # buffer name -> its attribute (b0, b1, ...)
        self._stages_fixed = False           # True once a pipeline rank's buffers are those of its stages
        # --- the pipeline around this rank (pp = 1: none) ----------------------------------------------
        pipelined = isinstance(program, PipelineProgram)
        staged = pipelined and program.mesh.pp > 1         # this rank holds some of the stages only
        self.peers = peers or [program.rank]
        self.tie_groups = dict(tie_groups or {})
        self.p2p_groups = dict(p2p_groups or {})
        # a tied weight is counted once in the gradient norm: by the lowest pp rank holding it
        self.duplicate_params = ({n for n, ranks in program.ties().items() if ranks[0] != program.pp_rank}
                                 if pipelined else set())
        # --- settings a training loop may change; every runner reads them at each call ------------------
        self.max_programs = max_programs         # programs kept per runner cache (parallelize(max_programs=))
        self.bucket_bytes = DEFAULT_BUCKET_BYTES   # dp gradient buckets of pm.step (DDP's bucket_cap_mb)
        self.first_bucket_bytes = None             # None: 1 MiB on CUDA, as the others on CPU (data_parallel.py)
        self.zero = getattr(program.options.pipeline, "zero", 0)   # pm.optimizer's default ZeRO stage
        self.post_receives_early = None      # every receive posted at the step's start: None = on gloo only
        self.timeout = datetime.timedelta(seconds=pg_timeout_seconds())
        # count the bytes each microbatch's forward saves for backward (a saved_tensors_hooks callback per
        # saved tensor, a few percent of a step on CPU): on when dumping, or set it for a benchmark
        self.measure_memory = dump_dir(program.options.dump) is not None
        self._check_every = check_replicas_every()
        self._steps = 0                      # training forwards run by pm(...)
        self._step_calls = 0                 # pm.step calls (AUTOSHARD_CHECK_REPLICAS counts both)
        self.train(model.training if not staged else True)
        training.check_same_weights(model, "parallelize", program.mesh.size)   # tp, dp, pp ranks and tied copies
        # --- the runners ----------------------------------------------------------------------------------
        self._step_compiler = step_compiler
        # a step program's module runs forwards only with a compiler to make them (parallelize's)
        self._forward = (None if staged or (pipelined and compiler is None)
                         else ForwardRunner(self, None if pipelined else program, compiler))
        self._first_runner = StepRunner(self, program) if pipelined else None
        # a pipeline rank holds the buffers of its training stages: another program reading one it does not
        # hold would read the model's initial value, not what was loaded since
        self._stages_fixed = staged
        self._runners = ProgramCache(lambda: self.max_programs, "step program", on_drop=lambda r: r.close())
        self._dp_checks = self._dp_eval_checks = 0   # pm.step / eval_batch calls (their batches compared over dp)
        self.runner = self._first_runner     # the runner of the last step (timelines read it)
        training.register_state_dict_names(self)

    # --- what the runners read ------------------------------------------------------------------------
    def buffer(self, name: str) -> torch.Tensor | None:
        """Model buffer ``name`` as this module holds it (registered here, a copy, the first time a program
        reads it, so state loads and ``.to()`` reach every program); None if the model has no such buffer."""
        if name not in self._buffer_attr:
            if name not in self._model_buffers:
                return None
            if self._stages_fixed:
                raise RuntimeError(f"a program for other inputs or eval mode reads buffer '{name}', which this rank's "
                                   "training stages do not hold: evaluate the single-device model on "
                                   "pm.full_state_dict()")
            self._buffer_attr[name] = f"b{len(self._buffer_names)}"
            self.register_buffer(self._buffer_attr[name], owned(self._model_buffers[name], self.device),
                                 persistent=name in self._persistent)
            self._buffer_names.append(name)
        return getattr(self, self._buffer_attr[name])

    def program_constant(self, program, name: str) -> torch.Tensor:
        """A constant ``program`` reads that is not a model buffer: one export lifted from its trace."""
        if name not in program.captured.constants:
            raise ValueError(f"buffer or constant '{name}' of the captured graph was not found in the model")
        return owned_constant(program.captured.constants[name], name, self.device)

    def _held_buffers(self) -> dict:
        return {b: self.buffer(b) for b in self._buffer_names}

    # --- programs -------------------------------------------------------------------------------------
    @property
    def program(self) -> Program | PipelineProgram:
        """The first program compiled: the example inputs' forward, in the model's mode at parallelize time,
        or their training step program (a pipeline's; at pp = 1 with dp > 1, the one that trains)."""
        return self._first_runner.program if self._first_runner is not None else self._forward.first

    def first_capture(self) -> tuple:
        """``(Captured, microbatches)`` of the first program: what a new call's inputs are checked against
        (a step program's capture is one microbatch of its batch)."""
        first = self._first_runner
        return self.program.captured, (first.schedule.microbatches if first is not None else 1)

    @property
    def programs(self) -> list:
        """The forward programs held now; a module built from a step program lists the step programs first."""
        forwards = [b.program for b in self._forward.programs.values()] if self._forward is not None else []
        if self._first_runner is None:
            return forwards
        return [self._first_runner.program] + [r.program for r in self._runners.values()] + forwards

    @property
    def forward_graphs(self) -> list:
        """The bound graph of each forward program held now (pp = 1), most recently used last."""
        return [b.graph for b in self._forward.programs.values()] if self._forward is not None else []

    @property
    def compile_log(self) -> list:
        """``(ProgramKey, seconds)`` per forward program compiled on first use (after the module's first
        program)."""
        return self._forward.compile_log if self._forward is not None else []

    @property
    def schedule(self):
        """The pipeline schedule of the last step (the first program's before any)."""
        runner = self.runner or self._first_runner
        return runner.schedule if runner is not None else None

    @property
    def graphs(self) -> nn.ModuleDict:
        """The first step program's bound stage graphs, by stage index."""
        return (self.runner or self._first_runner).graphs

    @property
    def step_runners(self) -> list:
        """Every step program's runner held now (the first one of a pipeline included)."""
        return ([self._first_runner] if self._first_runner is not None else []) + self._runners.values()

    def _runner_for(self, args, kwargs, training: bool) -> StepRunner:
        """The runner of the step program for this batch's shapes and mode: the first program, or one
        compiled on first use (an epoch's short last batch, eval mode) on the first's cuts and placements,
        so every runner works on the same parameter shards."""
        first = self._first_runner
        if training and first is not None and first.compiled_for(args, kwargs):
            return first
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = program_key(training, leaves, spec)
        runner = self._runners.get(key)
        if runner is None:
            captured, m = self.first_capture()
            check_dtype_kinds(leaves, captured, spec)     # before a step program is compiled for them
            warn_constant_inputs(key, self._runners.keys(), leaves, spec)
            if self._step_compiler is None:
                raise RuntimeError("pm.step for another batch shape or mode needs the compiler: build the module "
                                   "with autoshard.parallelize")
            start = time.perf_counter()
            with naming_new_shapes(leaves, captured, m, spec):
                program = self._step_compiler(args, kwargs, training)
            if first is not None:
                _check_same_stage_parameters(program, first.program, training)
            runner = self._runners.put(key, StepRunner(self, program, training))
            if first is not None or len(self._runners) > 1:
                log.info("autoshard: compiled a %s step program for inputs %s in %.2f s",
                         "training" if training else "eval", key.inputs, time.perf_counter() - start)
        return runner

    # --- calls ----------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._forward is None:
            why = ("a pipelined model runs whole batches" if self.comms["pp"].size > 1 else
                   "this module was built from a step program without a compiler (autoshard.parallelize's)")
            raise TypeError(f"{why}: call pm.step(*batch) (forward and backward over the microbatches, returning "
                            "the loss) or pm.eval_batch(*batch) (the eval-mode loss, no gradients); pm(...) runs a "
                            "forward only for pp=1, in a module autoshard.parallelize built")
        if self.training and self.comms["dp"].size > 1:
            raise RuntimeError(f"with data parallelism (dp={self.comms['dp'].size}) train with pm.step(*local_batch): "
                               "it sums the gradients over dp ranks; a training forward here would leave each "
                               "replica's gradients unsynchronised. pm.eval() forwards are fine")
        kwargs = in_example_order(kwargs, self.first_capture()[0])
        leaves, spec = pytree.tree_flatten(to_device((args, kwargs), self.device))
        flat, program = self._forward.run(leaves, spec, self.training)
        if self.training:
            self._steps += 1
            if check_finite_enabled(program.options.check_finite):
                training.check_finite(self, _scalar_loss(flat), self._steps, grads=False)
            if self._check_every and self._steps % self._check_every == 0:
                self.check_replicas()
        return pytree.tree_unflatten(list(flat), program.captured.out_spec)

    def step(self, *args, **kwargs) -> torch.Tensor:
        """Forward and backward of the whole batch: returns the loss (on every rank) and leaves each local
        shard's gradient in ``.grad`` (accumulated, as ``backward`` does). With ``microbatches=m`` the
        batch runs as m microbatches (gradient accumulation, or the pipeline's schedule) whose loss is the
        whole batch's: the summed cross-entropy divided by the batch's count of non-ignored targets
        (``passes/microbatch_loss.py``), so uneven ``ignore_index`` counts are exact. After ``pm.eval()``,
        as after ``model.eval()`` in torch, forward and backward run without dropout. Another batch shape
        compiles its own step program on first use (at most ``max_programs`` are kept)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("pm.step runs forward and backward and cannot run under torch.no_grad(); for a "
                               "validation loss call pm.eval_batch(*batch) (eval mode, no gradients)")
        args, kwargs = to_device((args, in_example_order(kwargs, self.first_capture()[0])), self.device)
        self._dp_checks += 1
        self._check_replicas_agree(args, kwargs, "pm.step", self._dp_checks)
        runner = self.runner = self._runner_for(args, kwargs, self.training)
        loss = runner.step(args, kwargs)
        self._step_calls += 1
        if self._check_every and self._step_calls % self._check_every == 0:   # AUTOSHARD_CHECK_REPLICAS=N
            self.check_replicas()
        return loss

    def _check_replicas_agree(self, args, kwargs, where: str, calls: int) -> None:
        """The dp replicas' batches of one shape and in range, before a program is chosen: a replica given
        other shapes would compile and run another program, whose collectives pair with the others'
        wrongly (a hang), and one whose token ids or labels are out of range raises alone while the others
        wait for it at the gradients' all-reduce. One all-gather of five numbers over dp, read back: every
        call on gloo (the host's own numbers); on NCCL, where the read waits for the GPU's queue, the first
        CHECKED_CALLS only (a replica whose shapes change later, alone, is not caught there; its ranges are
        asserted on the device)."""
        dp = self.comms.get("dp")
        if dp is None or dp.size == 1 or (calls > CHECKED_CALLS and uses_nccl()):
            return
        leaves, spec = pytree.tree_flatten((args, kwargs))
        captured, problem = self.first_capture()[0], None
        if spec == captured.in_spec:     # (a call of another structure is checked by its own program)
            try:
                check_call_inputs(captured, leaves)
            except Exception as e:  # noqa: BLE001 - raised after the all-gather, so no replica is left waiting
                problem = e
        check_same_shapes_over_dp(self.comms, leaves, where, problem)

    def eval_batch(self, *args, **kwargs) -> torch.Tensor:
        """The loss of a batch in eval mode (no dropout), forward only, on every rank: the same inputs and
        loss as ``step`` (the global batch's, over microbatches and dp), no gradients and no activations
        kept. Its program is compiled on first use (per batch shape), on the training program's stage cuts
        and placements, so it runs on the same parameter shards."""
        args, kwargs = to_device((args, in_example_order(kwargs, self.first_capture()[0])), self.device)
        self._dp_eval_checks += 1
        self._check_replicas_agree(args, kwargs, "pm.eval_batch", self._dp_eval_checks)
        return self._runner_for(args, kwargs, training=False).eval_batch(args, kwargs)

    # --- state ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The single-device state dict (original names, full shapes, tied names included), on every rank:
        each pp rank gathers its stages' shards over tp, then the stages are exchanged over pp."""
        pp = self.comms["pp"]
        # across pp on the CPU: all_gather_object pickles, and a CUDA tensor would unpickle on its sender's device
        move = (lambda t: t.cpu()) if pp.size > 1 else (lambda t: t)
        out = {name: move(self.gather(name, p.detach())).clone() for name, p in self.local_parameters().items()}
        for b in self._buffer_names:
            if b in self._persistent:
                out[b] = move(self.buffer(b)).clone()
        if pp.size > 1:
            out = {k: v for part in pp.all_gather_objects(out) for k, v in part.items()}
        for alias, main in self.aliases.items():
            if main in out:
                out[alias] = out[main]
        return out

    # --- the last step's timeline ---------------------------------------------------------------------
    @property
    def last_dp_wait(self) -> float:
        """Seconds the last step's end waited for its dp all-reduces (what backward did not hide)."""
        reducer = self.runner.dp_reducer if self.runner is not None else None
        return reducer.waited_seconds() if reducer is not None else 0.0

    @property
    def last_timeline(self):
        """This rank's timeline of the last ``step``: when each of its actions ran, from the clock that saw
        it run (CUDA events on a GPU, so reading it waits for that step's work)."""
        return self.runner.last_timeline if self.runner is not None else None

    def measured_timeline(self):
        """The last step's timeline over every pp rank (a collective over pp): what the dump draws."""
        return self.runner.measured_timeline()


def _check_cuda_graphs(program, device) -> None:
    """``cuda_graphs=True`` needs a rank computing on CUDA: say so before anything is bound."""
    if program.options.cuda_graphs and (device is None or device.type != "cuda"):
        where = device.type if device is not None else "no device (the model holds no parameters)"
        raise ValueError(f"cuda_graphs=True replays each program as CUDA graphs, but this rank computes on {where}: "
                         "build the mesh on CUDA (autoshard.init_mesh under torchrun with NCCL) and the model there, "
                         "or leave cuda_graphs off")


def _scalar_loss(flat):
    """The loss among a program's outputs: its first scalar floating tensor (None if it returns none)."""
    return next((x for x in flat if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()), None)


def _check_same_stage_parameters(program, first, training: bool) -> None:
    """A pipeline's stages hold the parameters the first program placed on them. A later program (new shapes,
    eval mode) must put the same ones on each stage; one of another form (``inputs_embeds=`` where the
    example passed ``input_ids=`` skips the embedding, and the balancer then cuts elsewhere) cannot run
    on these shards. Every stage is compared, not only this rank's, so every rank raises alike."""
    def names(p):
        return {c.index: set(c.param_names) for c in p.chunks}
    mine, theirs = names(program), names(first)
    if mine == theirs:
        return
    stage = next(i for i in sorted(set(mine) | set(theirs)) if mine.get(i) != theirs.get(i))
    now, before = mine.get(stage, set()), theirs.get(stage, set())
    unused, new = sorted(before - now), sorted(now - before)
    what = "; ".join(p for p in (f"leaves {unused[:3]} unread" if unused else "",
                                 f"reads {new[:3]}, which the first program put elsewhere" if new else "") if p)
    raise InputError(f"pm.step / eval_batch: the {'training' if training else 'eval'}-mode program for these inputs "
                     f"puts other parameters on stage {stage} than the first program did (it {what}), but a "
                     "pipeline's stages keep the parameters the first program put on them. A call of another form "
                     "does this (inputs_embeds= where the example passed input_ids=, which skips the embedding): "
                     "call with the example's inputs (the same keywords), or build pm "
                     "with an example of this form")

