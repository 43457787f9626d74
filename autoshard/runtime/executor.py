"""One pipeline step on one rank: ``Run`` walks the rank's action list (``ir.schedule``) over its
stages' graphs, through a ``StepRunner`` (``runtime/step_runner.py``): its stage graphs and inputs,
the step's leaves and the loss's divisor, and the module's transfer settings.

- ``F``: run the stage's graph on the received boundary (a leaf that requires grad), keep the input and
  the output until the backward, and queue the output for the next stage;
- ``B``: ``autograd.backward`` from the output with the received gradient (from the loss on the last
  stage), queue the input's gradient for the previous stage, then drop both: an activation lives from
  its forward to its backward and no longer. In a split (zero-bubble) schedule the matmuls' weight
  gradients are left for W (``ir/weight_grad.py``): B keeps their inputs and output gradients;
- ``W``: those weight gradients, accumulated into the parameters (the dp reducer arms at a stage's last
  W instead of its last B);
- ``SEND_*``/``RECV_*``: consecutive transfers go out as one ``batch_isend_irecv`` per direction (each
  ordered pair of pp ranks has its own group, ``api._p2p_groups``: NCCL orders a group's transfers on one
  stream, and one group for both directions deadlocks the interleaved schedule); a receive is waited
  for only when a compute needs it, sends at the end of the step. Shapes and dtypes come from the
  compiled chunks, so no shape handshake precedes a transfer. Tags name (direction, stage, microbatch).

Sends never block and the schedule's dependency graph is acyclic (``schedule.validate``), so the walk
cannot deadlock. A wait that fails (a peer raised or died) or outlives ``AUTOSHARD_TIMEOUT`` raises on
this rank, naming the peer, so every rank exits with an error within the timeout.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.ir.schedule import Action, Kind, whole_backwards
from autoshard.ir.simulator import Span
from autoshard.ir.weight_grad import WeightGrads, deferring, splitting
from autoshard.runtime.clock import Recorded, StepClock
from autoshard.runtime.scatter_gather import scatter_gather

class PipelineError(RuntimeError):
    """A pipeline transfer failed or timed out: a peer rank raised, died or is stuck."""


class Denominator:
    """The global target count, possibly still being summed over dp."""

    def __init__(self, total: torch.Tensor, work=None):
        self.total, self.work = total, work

    def value(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.total.reshape(())

    def reciprocal(self, dtype) -> torch.Tensor:
        return (1.0 / self.value()).to(dtype)


def _tag(kind: Kind, sender: int, microbatch: int, m: int) -> int:
    """One tag per transfer: (direction, sending stage, microbatch)."""
    return 1 + (2 * sender + (kind in (Kind.SEND_B, Kind.RECV_B))) * m + microbatch


class Run:
    """One step on one rank: the inbox of received values, the saved activations, the pending transfers."""

    def __init__(self, runner, users: list, grads_held: bool, forward_only: bool = False):   # runner: StepRunner
        self.runner, self.users, self.denominator = runner, users, None
        self.forward_only = forward_only       # eval_batch: forwards alone, nothing kept for a backward
        prog = runner.program
        self.sched, self.m, self.me = prog.schedule, prog.schedule.microbatches, prog.pp_rank
        self.chunks = {c.index: c for c in prog.own}
        self.inbox, self.outbox, self.saved = {}, {}, {}
        self.pending, self.sends = [], []
        self.param_inputs = {}       # stage -> the graph's parameter inputs (local, padded, cast), per step
        if forward_only:
            self.leaves, self.reducer = runner.params.step_leaves(list(runner.params.records)), None
        else:
            self.leaves, self.reducer = runner.step_leaves(grads_held)
        # receive buffers, the loss and its divisor live where the step computes (NCCL takes no CPU tensors)
        self.device = _step_device(self.leaves, users)
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        # stage -> its last action that accumulates gradients this step (B; W in a split schedule): the
        # reducer arms there
        mine = prog.schedule.actions.get(self.me, [])
        # (stage, microbatch) whose backward runs as B then W: every W's, but the stage-0 ones run whole
        whole = whole_backwards(mine)
        self.split = {(a.stage, a.microbatch) for a in mine if a.kind is Kind.W} - whole
        self.weight_grads: dict = {}           # (stage, microbatch) -> WeightGrads, from B to W
        self.arms = arming_points(mine, self.split)
        self.param_storages = {t.untyped_storage().data_ptr() for t in self.leaves.values()} \
            if runner.measure_memory else set()
        self.held = self.peak = 0
        self.clock = StepClock(self.device)
        self.stream_waits = _backend() == "nccl"
        pipe = prog.options.pipeline
        self.scatter = scatter_gather(pipe.scatter_gather if pipe is not None else False,
                                      runner.module.comms["tp"], self.chunks)
        self.record = Recorded(self.sched.name, self.sched.pp, self.me, self.clock)

    # transfers ----------------------------------------------------------------------------------------
    def _sliced(self, a: Action) -> bool:
        """Whether ``a``'s tensor goes as tp slices (``runtime/scatter_gather.py``)."""
        return self.scatter is not None and self.scatter.sliced(a)

    def _peer(self, a: Action) -> int:
        stage = a.stage + (1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else -1)
        return self.sched.rank_of(stage)

    def _post(self, a: Action) -> None:
        peer_pp = self._peer(a)
        peer = self.runner.peers[peer_pp]
        sending = a.kind in (Kind.SEND_F, Kind.SEND_B)
        # the group of this transfer's direction (api._p2p_groups); None: the world group
        group = self.runner.p2p_groups.get((self.me, peer_pp) if sending else (peer_pp, self.me))
        if sending:
            key = ("F" if a.kind is Kind.SEND_F else "B", a.stage, a.microbatch)
            tensor = self.outbox.pop(key).contiguous()
            if self._sliced(a):
                tensor = self.scatter.part(tensor)
            self.pending.append((a, dist.P2POp(dist.isend, tensor, peer, group=group,
                                               tag=_tag(a.kind, a.stage, a.microbatch, self.m)), tensor))
        else:
            chunk = self.chunks[a.stage]
            forward = a.kind is Kind.RECV_F
            shape, dtype = (chunk.in_shape, chunk.in_dtype) if forward else (chunk.out_shape, chunk.out_dtype)
            tensor = (self.scatter.buffer(shape, dtype, self.device) if self._sliced(a)
                      else torch.empty(shape, dtype=dtype, device=self.device))
            sender = a.stage - 1 if forward else a.stage + 1
            op = dist.P2POp(dist.irecv, tensor, peer, group=group, tag=_tag(a.kind, sender, a.microbatch, self.m))
            self.pending.append((a, op, tensor))

    def _flush(self) -> None:
        """Start the pending transfers: one ``batch_isend_irecv`` per group (a batch must be on one group)."""
        if not self.pending:
            return
        batches = {}
        for item in self.pending:
            batches.setdefault(id(item[1].group), []).append(item)
        for batch in batches.values():
            works = dist.batch_isend_irecv([op for _, op, _ in batch])
            if len(works) != len(batch):   # NCCL coalesces the batch into one work: each transfer waits on it
                works = [works[0]] * len(batch)
            self._started(batch, works)
        self.pending = []

    def _started(self, batch, works) -> None:
        for (a, _, tensor), work in zip(batch, works):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                self.sends.append((a, work, tensor))
            else:
                key = ("F" if a.kind is Kind.RECV_F else "B", a.stage, a.microbatch)
                self.inbox[key] = (a, work, tensor)

    def _wait(self, a: Action, work) -> None:
        peer = self.runner.peers[self._peer(a)]
        try:
            # NCCL: wait() with a timeout blocks the host, polling every millisecond, where without one it
            # only makes the compute stream wait; there the group's own timeout (AUTOSHARD_TIMEOUT, which
            # NCCL's watchdog enforces by aborting the process with an error) bounds a dead peer instead
            ok = work.wait() if self.stream_waits else work.wait(self.runner.timeout)
        except Exception as e:  # noqa: BLE001 - name the peer, whatever the backend raised
            raise PipelineError(f"pipeline rank {self.me}: {a} (with global rank {peer}) failed after "
                                f"{self.clock.host_seconds():.1f} s: {type(e).__name__}: "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. Rank {peer} probably "
                                "raised or died: see its error") from e
        if ok is False:
            raise PipelineError(f"pipeline rank {self.me}: {a} (with global rank {peer}) did not complete within "
                                f"AUTOSHARD_TIMEOUT={self.runner.timeout.total_seconds():.0f} s")

    def _take(self, key):
        value = self.inbox.pop(key)
        if isinstance(value, tuple):
            a, work, tensor = value
            t0 = self.clock.mark()
            self._wait(a, work)
            if self._sliced(a):
                tensor = self.scatter.whole(tensor, a)
            self.record.spans.append(Span(a, t0, self.clock.mark()))
            return tensor
        return value

    # compute ------------------------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        chunk = self.chunks[a.stage]
        x = None
        if a.stage > 0:
            x = self._take(("F", a.stage, a.microbatch)).detach().requires_grad_(not self.forward_only)
        t0 = self.clock.mark()
        graph = self.runner.graph(a.stage)
        if a.stage not in self.param_inputs:   # once per step: the same local leaves feed every microbatch
            self.param_inputs[a.stage] = self.runner.params.local_inputs(chunk.params, self.leaves)
        inputs = self.runner.stage_inputs(chunk, x, self.users[a.microbatch], self.param_inputs[a.stage])
        saved = _SavedBytes(self.param_storages) if self.runner.measure_memory else None
        with splitting() if (a.stage, a.microbatch) in self.split else contextlib.nullcontext():
            if saved is None:
                out = graph(*inputs)
            else:
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    out = graph(*inputs)
        if chunk.last:
            self.loss = self.loss + out.detach().float()
        elif self.sched.rank_of(a.stage + 1) == self.me:
            self.inbox[("F", a.stage + 1, a.microbatch)] = out.detach()
        else:
            self.outbox[("F", a.stage, a.microbatch)] = out.detach()
        nbytes = saved.bytes if saved is not None else 0
        if not self.forward_only:
            self.saved[a.stage, a.microbatch] = (x, out, nbytes)
        self._done(a, t0)
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _backward(self, a: Action) -> None:
        chunk = self.chunks[a.stage]
        x, out, nbytes = self.saved.pop((a.stage, a.microbatch))
        grad = None if chunk.last else self._take(("B", a.stage, a.microbatch))
        self._arm(a)
        if chunk.last:     # seed with 1 / (the global batch's count): the loss is the global mean
            grad = self.denominator.reciprocal(out.dtype)
        t0 = self.clock.mark()
        if out.requires_grad:     # not when every parameter of a first stage is frozen: nothing to do
            if (a.stage, a.microbatch) in self.split:     # a recomputed forward splits alike, inside the block
                with deferring(WeightGrads()) as kept:
                    torch.autograd.backward(out, grad)
                self.weight_grads[a.stage, a.microbatch] = kept
                # after B: the forward's saved tensors are gone, what W reads stays (counted, as a
                # forward's are, once B is done: the transient of the backward itself is neither's)
                self.held += kept.nbytes if self.runner.measure_memory else 0
            else:
                torch.autograd.backward(out, grad)
        self.held -= nbytes
        self.peak = max(self.peak, self.held)
        if x is not None:
            if self.sched.rank_of(a.stage - 1) == self.me:
                self.inbox[("B", a.stage - 1, a.microbatch)] = x.grad
            else:
                self.outbox[("B", a.stage, a.microbatch)] = x.grad
        del x, out
        self._done(a, t0)

    def _weight(self, a: Action) -> None:
        """W: the weight gradients B left for this stage and microbatch."""
        kept = self.weight_grads.pop((a.stage, a.microbatch), None)
        self._arm(a)
        t0 = self.clock.mark()
        if kept is not None:
            self.held -= kept.nbytes if self.runner.measure_memory else 0
            kept.run()
        self._done(a, t0)

    def _arm(self, a: Action) -> None:
        """Before the action after which a stage's gradients are final, tell the dp reducer so: their
        hooks then launch the buckets as they fill. Split, the gradients W computes are final at the
        stage's last W, the others (norms, biases, embeddings) at its last B."""
        if self.reducer is not None:
            for phase in self.arms.get(a, ()):
                self.reducer.arm(a.stage, phase)

    def _done(self, a: Action, t0) -> None:
        self.record.spans.append(Span(a, t0, self.clock.mark()))

    def execute(self, actions: list) -> None:
        """Walk the actions. Every receive of the step is posted up front (its buffer's shape is known
        from the compiled chunks), so a transfer runs as soon as its sender sends, while this rank
        computes, instead of starting when the data is needed. The buffers are the boundary tensors of
        the step's microbatches: small next to the activations they feed. Sends go out right after the
        compute that made them."""
        # up front on gloo, whose transfers each run on their own; NCCL runs a group's transfers in order on
        # one stream and completes a batch as one work, so a batch of every receive would finish only with
        # the step's last: there each receive is posted at its place in the action list (batched with the
        # sends next to it, one batch per direction's group)
        early = self.runner.post_receives_early
        up_front = _backend() == "gloo" if early is None else early
        if up_front:
            for a in actions:
                if a.kind in (Kind.RECV_F, Kind.RECV_B):
                    self._post(a)
            self._flush()
        # counted while the first receive is in flight (a later stage waits for it anyway)
        self.denominator = self.runner.denominator(self.users, self.device)
        for a in actions:
            if a.is_compute:
                self._flush()
                {Kind.F: self._forward, Kind.B: self._backward, Kind.W: self._weight}[a.kind](a)
            elif a.kind in (Kind.SEND_F, Kind.SEND_B) or not up_front:
                self._post(a)
        self._flush()
        for a, work, _ in self.sends:
            self._wait(a, work)
        if self.saved or self.weight_grads:
            raise RuntimeError(f"internal: the schedule left {sorted(self.saved) or sorted(self.weight_grads)} "
                               "without a backward or W")
        if self.denominator is not None:
            self.loss = self.loss / self.denominator.value()

    def recorded(self) -> Recorded:
        """The step's marks (``Recorded.timeline()`` reads them: on a GPU that waits for the step's work)."""
        self.record.end, self.record.peak = self.clock.mark(), self.peak
        return self.record


def arming_points(actions: list, split: set) -> dict:
    """``{action: phases}``: where the dp reducer arms (``DataParallelReducer.arm``). Unsplit, a stage's
    last B finishes every gradient (phase None). Split, the gradients B computes ("B": outside the
    matmuls W defers) are final at the stage's last B; the deferred ones ("W") at its last action that
    computes them: a W, or a B run whole."""
    last_b, last_w = {}, {}
    for a in actions:
        if a.kind is Kind.B:
            last_b[a.stage] = a
            if (a.stage, a.microbatch) not in split:
                last_w[a.stage] = a
        elif a.kind is Kind.W and (a.stage, a.microbatch) in split:
            last_w[a.stage] = a
    if not split:
        return {a: (None,) for a in last_b.values()}
    out: dict = {}
    for stage, a in last_b.items():
        out.setdefault(a, []).append("B")
    for stage, a in last_w.items():
        out.setdefault(a, []).append("W")
    return out


def _backend() -> str:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else "gloo"


def _step_device(leaves: dict, users: list) -> torch.device:
    """Where the step computes: its parameters' device, or its inputs' for a rank holding none."""
    for t in list(leaves.values()) + [v for u in users for v in u.values()]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


class _SavedBytes:
    """Counts the bytes autograd saves during one forward (each storage once; a parameter's own storage
    is not an activation, but a cast or padded copy of it is): the activation memory one microbatch holds."""

    def __init__(self, exclude=frozenset()):
        self.bytes, self._seen = 0, set(exclude)

    def pack(self, t):
        if not isinstance(t, nn.Parameter):
            key = t.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t
