"""Pipeline parity, run on gloo ranks: the loss and every gradient of ``pm.step`` against the single-device
model on the whole batch, then optimizer steps (shared by tests/distributed/test_pipeline.py and the demo checks)."""
from __future__ import annotations

import contextlib
import copy
import queue
import threading
from unittest import mock

import torch

import autoshard
from autoshard.ir.pipeline import PipelineProgram
from tests.harness import families
from tests.harness.models import batch, build, loss_and_logits


def ragged_batch(kind, vocab, B, T, seed):
    """A batch whose microbatches hold different numbers of ignored targets (-100). HF models are called
    with keywords, as users call them (a family model also gets a left-padded attention mask)."""
    if kind == "family":
        args, kwargs = (), families.batch(vocab, B=B, T=T, seed=seed)
    else:
        args, kwargs = batch(kind, vocab, B=B, T=T, seed=seed)
    labels = args[1] if kind == "gpt" else kwargs["labels"]
    labels[0, : T - 1] = -100          # the first row (microbatch 0) keeps one target
    labels[-1, : T // 2] = -100
    return args, kwargs


def build_model(kind, cfg):
    """``("gpt"|"hf", config keywords)`` from tests/harness/models.py, or ``("family", FamilyConfig keywords)``."""
    if kind == "family":
        fc = families.FamilyConfig(**cfg)
        return families.build(fc), fc.vocab
    return build(kind, **cfg), cfg.get("vocab_size", 96 if kind == "gpt" else 101)


def _loss(kind, out):
    return out.loss if kind == "family" else loss_and_logits(kind, out)[0]


class _StreamWork:
    """NCCL's answer to ``batch_isend_irecv``: one work for the whole batch, done when all its transfers are
    (waiting on it again is fine, as on NCCL)."""
    def __init__(self):
        self.event, self.error = threading.Event(), None

    def wait(self, timeout=None):
        if not self.event.wait(timeout.total_seconds() if timeout is not None else None):
            return False
        if self.error is not None:
            raise self.error
        return True


class _Stream:
    """One NCCL communicator's stream, over gloo: its batches run one after another in the order this rank
    issued them (a thread runs each to completion before the next), and the host does not wait for that
    unless it waits on a work. Two directions sharing one stream then wait on each other in a cycle,
    as on NCCL once activations outgrow its buffers."""
    def __init__(self, batch_isend_irecv):
        self.issue, self.queue = batch_isend_irecv, queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            ops, work = self.queue.get()
            try:
                for w in self.issue(ops):
                    w.wait()
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the work
                work.error = e
            work.event.set()


def _nccl_streams(batch_isend_irecv):
    streams = {}

    def one_work(ops):
        key = id(ops[0].group)
        if key not in streams:
            streams[key] = _Stream(batch_isend_irecv)
        work = _StreamWork()
        streams[key].queue.put((ops, work))
        return [work]
    return one_work


def pipeline_parity(rank, world, kind, mesh, options, cfg, steps=3, B=4, T=8):
    """Per step: |loss - ref| / |ref| and the largest gradient error (relative to the largest gradient);
    then the final parameters' error, and whether tied copies stayed bit-identical."""
    options = dict(options)
    clip = options.pop("clip", None)      # clip every step with pm.clip_grad_norm_ (the norm over all stages)
    zero = options.get("zero", 0)         # ZeRO-1: pm.optimizer shards AdamW's state over dp
    accumulate = options.pop("accumulate", False)   # two pm.step calls per optimizer step, no zero_grad
    late = options.pop("late_receives", False)      # NCCL's semantics on gloo: each receive posted at its action,
                                                    # one work per batch, a group's batches run in order
    bucket = options.pop("bucket_bytes", None)      # dp buckets of this size, the first too (many all-reduces)
    fused = options.pop("fused", False)             # AdamW(fused=True) on both sides (runtime/fused_optim.py)
    evaluate = options.pop("eval", False)           # then pm.eval_batch against the model's eval-mode loss
    forwards = options.pop("forwards", False)       # dp > 1, pp = 1: pm(...) refuses to train, evaluates exactly
    options.pop("expect", None)                     # the schedule the test expects "auto" to choose (_check)
    model, vocab = build_model(kind, cfg)
    ref = copy.deepcopy(model)
    dp = mesh.get("dp", 1)            # each dp rank steps on its rows of a global batch of B * dp
    device_mesh = autoshard.init_mesh(**mesh)
    args, kwargs = ragged_batch(kind, vocab, B * dp, T, seed=1)
    pm = autoshard.parallelize(model, device_mesh, *autoshard.local_batch((args, kwargs), device_mesh), **options)
    if late:
        pm.post_receives_early = False
    if bucket is not None:
        pm.bucket_bytes = pm.first_bucket_bytes = bucket
    if forwards:       # a ParallelModule at dp > 1 (pp = 1): eval forwards work, training ones must refuse
        assert dp > 1 and mesh.get("pp", 1) == 1, "forwards=True checks a dp > 1, pp = 1 module"
        # built from its step program (the one that trains here): no forward program yet, one trace
        assert isinstance(pm.program, PipelineProgram) and not pm.forward_graphs and pm.captures.traced == 1
        local_args, local_kwargs = autoshard.local_batch((args, kwargs), device_mesh)
        try:
            pm(*local_args, **local_kwargs)
            raise AssertionError("a training forward with dp > 1 should refuse")
        except RuntimeError as e:
            assert "train with pm.step" in str(e)
        pm.eval()
        ref.eval()
        got = _loss(kind, pm(*local_args, **local_kwargs))
        want = _loss(kind, ref(*local_args, **local_kwargs))
        assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
        assert len(pm.forward_graphs) == 1 and pm.captures.traced == 2     # the eval forward's, on first use
        pm.train()
        ref.train()
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-4, fused=fused) if zero else \
        torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-4, fused=fused)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4, fused=fused)
    losses, grads, norms = [], [], []
    for step in range(steps):
        loss = rloss = 0.0
        for seed in ([10 + step, 50 + step] if accumulate else [10 + step]):
            args, kwargs = ragged_batch(kind, vocab, B * dp, T, seed=seed)
            local_args, local_kwargs = autoshard.local_batch((args, kwargs), device_mesh)
            loss = pm.step(*local_args, **local_kwargs)
            rloss = _loss(kind, ref(*args, **kwargs))
            rloss.backward()
        losses.append(abs(float(loss) - float(rloss.detach())) / abs(float(rloss.detach())))
        rgrad = dict(ref.named_parameters(remove_duplicate=False))
        scale = max(float(p.grad.abs().max()) for p in ref.parameters())
        err = 0.0
        for name, p in pm.local_parameters().items():
            full = pm.gather(name, p.grad).cpu()      # the reference runs on the CPU, pm where its mesh is
            err = max(err, float((full - rgrad[name].grad).abs().max()) / scale)
        grads.append(err)
        if clip is not None:
            norm = float(pm.clip_grad_norm_(clip))
            rnorm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
            norms.append(abs(norm - rnorm) / rnorm)
        opt.step(); ropt.step(); opt.zero_grad(); ropt.zero_grad()
    full = {k: v.cpu() for k, v in pm.full_state_dict().items()}
    scale = max(float(p.detach().abs().max()) for p in ref.parameters())
    final = max(float((full[n] - p).abs().max()) / scale for n, p in ref.state_dict().items() if p.is_floating_point())
    tied = {}
    for name, p in pm.local_parameters().items():
        if name in pm.tie_groups:
            local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            every = [torch.empty_like(local) for _ in range(2)]
            torch.distributed.all_gather(every, local.contiguous(), group=pm.tie_groups[name])
            tied[name] = bool(torch.equal(every[0], every[1]))
    prog = pm.runner.program          # the last step's program (pp = 1: a one-stage pipeline)
    eval_err = None
    if evaluate:                      # another program on the training program's cuts and schedule
        args, kwargs = ragged_batch(kind, vocab, B * dp, T, seed=99)
        local_args, local_kwargs = autoshard.local_batch((args, kwargs), device_mesh)
        got = float(pm.eval_batch(*local_args, **local_kwargs))
        ref.eval()
        with torch.no_grad():
            want = float(_loss(kind, ref(*args, **kwargs)))
        eval_err = abs(got - want) / abs(want)
    state = opt.state_bytes() if zero else sum(v.numel() * v.element_size() for st in opt.state.values()
                                               for v in st.values() if torch.is_tensor(v) and v.dim())
    scattered = sum(n for (axis, phase, kind), n in pm.comm_counts()[0].items() if phase == "p2p")
    return dict(losses=losses, grads=grads, norms=norms, final=final, state_bytes=state, tied=tied, ties=prog.ties(), exact=prog.loss.exact,
                stages=[c.index for c in prog.own], schedule=prog.schedule.name, eval=eval_err, scattered=scattered)


def run_configs(rank, world, configs):
    """Several parity runs in one process group: ``[(kind, mesh, options, cfg)]`` -> results."""
    results = []
    for c in configs:
        nccl_like = c[2].get("late_receives", False)
        with mock.patch.object(torch.distributed, "batch_isend_irecv", _nccl_streams(torch.distributed.batch_isend_irecv)) \
                if nccl_like else contextlib.nullcontext():
            results.append(pipeline_parity(rank, world, *c))
    return results
