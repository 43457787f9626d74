"""What a real training loop does beyond the happy path, on 4 gloo ranks (``tests/distributed/test_loop_edges.py``):
frozen parameters, param groups and an LR scheduler on the ZeRO-1 optimizer, a vocab that tp does not
divide, a summed loss over microbatches, checkpoints with frozen parameters and a trailing slash, and
real weights loaded into a pipelined model. Each case is checked against the single-device model."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import autoshard
from autoshard.ir.errors import InputError
from tests.harness.models import batch, build

VOCAB = 97                  # tp=2 cuts it 49 + 48: uneven shards, padded on rank 1


def _global(step):
    args, _ = batch("gpt", VOCAB, B=8, seed=10 + step)
    args[1][0, :5] = -100                       # uneven ignored targets over dp ranks and microbatches
    return args


def _keywords(args):
    """A batch as an HF user passes it: ``input_ids=``, ``labels=``, ``use_cache=False``."""
    return dict(input_ids=args[0], labels=args[1], use_cache=False)


def _groups(names):
    """The usual two groups: weight decay on matrices, none on biases, norms and position embeddings."""
    no_decay = [n for n in names if n.endswith("bias") or "ln" in n or "wpe" in n]
    return [{"params": [n for n in names if n not in no_decay]}, {"params": no_decay, "weight_decay": 0.0}]


def _reference_run(model, steps, lam):
    """The single-device model with the same groups and scheduler on the global batches."""
    ref = copy.deepcopy(model)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    by = dict(ref.named_parameters())
    opt = torch.optim.AdamW([{**g, "params": [by[n] for n in g["params"]]} for g in _groups(names)],
                            lr=1e-2, eps=1e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    losses = []
    for step in range(steps):
        _, loss = ref(*_global(step))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def zero_groups_scheduler_frozen_and_checkpoint(rank, world, path):
    """dp=2 x tp=2, ZeRO-1, vocab 97, wpe frozen, two param groups and LambdaLR; then a save to
    ``path/`` and a resume that continues bit-identically."""
    mesh = autoshard.init_mesh(dp=2, tp=2)
    model = build("gpt", vocab_size=VOCAB, n_layer=2)
    model.transformer.wpe.weight.requires_grad_(False)
    lam = (lambda s: 1.0 / (1 + s))

    def make():
        pm = autoshard.parallelize(copy.deepcopy(model), mesh, *autoshard.local_batch((_global(0), {}), mesh),
                                   microbatches=2, zero=1)
        names = [n for n, p in pm.named_parameters() if p.requires_grad]
        opt = pm.optimizer(torch.optim.AdamW, _groups(names), lr=1e-2, eps=1e-4, weight_decay=0.1)
        return pm, opt

    pm, opt = make()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    losses = []
    for step in range(2):
        losses.append(float(pm.step(*autoshard.local_batch((_global(step), {}), mesh)[0])))
        opt.step()
        sched.step()
        opt.zero_grad()
    want_losses, want_state = _reference_run(model, 2, lam)
    full = pm.full_state_dict()
    worst = max(float((full[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)) for k, v in want_state.items())
    autoshard.save(pm, opt, path + "/", step=2, scheduler=sched)
    straight = float(pm.step(*autoshard.local_batch((_global(2), {}), mesh)[0]))
    opt.step()
    sched.step()
    after = pm.full_state_dict()
    pm2, opt2 = make()
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lam)        # built as the saving run built it
    start = autoshard.load(pm2, opt2, path + "/", scheduler=sched2)
    resumed = float(pm2.step(*autoshard.local_batch((_global(2), {}), mesh)[0]))
    opt2.step()
    sched2.step()
    after2 = pm2.full_state_dict()
    # an epoch's short last batch (4 rows, not 8): pm.step compiles a program for it on first use
    short, _ = batch("gpt", VOCAB, B=4, seed=99)
    opt2.zero_grad()
    short_loss = float(pm2.step(*autoshard.local_batch((short, {}), mesh)[0]))
    ref = copy.deepcopy(model)
    ref.load_state_dict(after2)
    _, want_short = ref(*short)
    short_eval = float(pm2.eval_batch(*autoshard.local_batch((short, {}), mesh)[0]))   # pp = 1: a validation loss
    return dict(short_loss=short_loss, want_short=float(want_short), steppers=sum(r.training_mode for r in pm2.step_runners),
                short_eval=short_eval,
                losses=losses, want_losses=want_losses, worst=worst, start=start, straight=straight,
                resumed=resumed, same=all(torch.equal(after[k], after2[k]) for k in after),
                lr=[g["lr"] for g in opt.param_groups], want_lr=[1e-2 * lam(3)] * 2,
                resumed_lr=[g["lr"] for g in opt2.param_groups], resumed_epoch=sched2.last_epoch,
                wpe_same=torch.equal(after["transformer.wpe.weight"], model.transformer.wpe.weight))


def pipeline_frozen_tied_and_real_weights(rank, world):
    """dp=2 x pp=2 with the first stage holding only frozen weights (the tied wte/lm_head, wpe, block 0):
    the step runs, its gradients are the single-device ones, the frozen tied copies do not move under
    weight decay; unfreezing block 0 after a step gives it gradients; real weights load into the pipeline;
    a step under no_grad says why it cannot run."""
    mesh = autoshard.init_mesh(dp=2, pp=2)
    model = build("gpt", vocab_size=VOCAB, n_layer=3)
    frozen = ("transformer.wte.", "transformer.wpe.", "transformer.h.0.")
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(frozen))
    pm = autoshard.parallelize(copy.deepcopy(model), mesh, *autoshard.local_batch((_global(0), {}), mesh),
                               microbatches=2, pipeline_cuts=[1])
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.5)
    before = pm.full_state_dict()
    loss = float(pm.step(*autoshard.local_batch((_global(0), {}), mesh)[0]))
    ref = copy.deepcopy(model)
    _, ref_loss = ref(*_global(0))
    ref_loss.backward()
    grads = {}
    for name, p in pm.named_parameters():
        g = pm.gather(name, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) if p.grad is not None \
            else None
        grads[name] = g
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    grad_err = max((float((grads[n] - ref_grads[n].grad).abs().max()) for n in grads if grads[n] is not None),
                   default=0.0)
    frozen_grads = [n for n in grads if n.startswith(frozen) and grads[n] is not None]
    opt.step()
    opt.zero_grad()
    after = pm.full_state_dict()
    frozen_moved = [k for k in before if k.startswith(frozen) and not torch.equal(before[k], after[k])]
    # unfreeze block 0 (on the rank holding it): its next step gives it gradients
    for name, p in pm.named_parameters():
        if name.startswith("transformer.h.0."):
            p.requires_grad_(True)
    pm.step(*autoshard.local_batch((_global(1), {}), mesh)[0])
    unfrozen = [n for n, p in pm.named_parameters() if n.startswith("transformer.h.0.")]
    unfrozen_have_grads = all(p.grad is not None for n, p in pm.named_parameters() if n in unfrozen)
    # real weights into the pipeline (a model built on meta would load this way)
    torch.manual_seed(5)
    real = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    real["lm_head.weight"] = real["transformer.wte.weight"]          # tied: one tensor under two names
    pm.load_full_state_dict(real)
    loaded = pm.full_state_dict()
    load_ok = all(torch.equal(loaded[k], real[k]) for k in loaded if k in real)
    try:
        with torch.no_grad():
            pm.step(*autoshard.local_batch((_global(0), {}), mesh)[0])
        no_grad_error = None
    except RuntimeError as e:
        no_grad_error = str(e)
    return dict(loss=loss, ref_loss=float(ref_loss), grad_err=grad_err, frozen_grads=frozen_grads,
                frozen_moved=frozen_moved, unfrozen=unfrozen, unfrozen_have_grads=unfrozen_have_grads,
                load_ok=load_ok, no_grad_error=no_grad_error)


class SummedLoss(torch.nn.Module):
    """A GPT whose loss is the summed cross-entropy (reduction='sum')."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        logits, _ = self.gpt(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="sum")


def summed_loss_over_microbatches_and_dp(rank, world):
    """A summed loss is the sum over microbatches and dp replicas, not their mean (dp=2 x pp=2, m=2)."""
    mesh = autoshard.init_mesh(dp=2, pp=2)
    model = SummedLoss(build("gpt", vocab_size=VOCAB, n_layer=2))
    pm = autoshard.parallelize(copy.deepcopy(model), mesh, *autoshard.local_batch((_global(0), {}), mesh),
                               microbatches=2)
    loss = float(pm.step(*autoshard.local_batch((_global(0), {}), mesh)[0]))
    ref = copy.deepcopy(model)
    ref_loss = ref(*_global(0))
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in pm.named_parameters():
        if p.grad is not None:
            g = pm.gather(name, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
            want = ref_grads[name].grad
            worst = max(worst, float((g - want).abs().max() / want.abs().max()))
    # an epoch's short last batch (4 rows, not 8) under pp: a twin program on the same cuts and shards
    short, _ = batch("gpt", VOCAB, B=4, seed=98)
    short_loss = float(pm.step(*autoshard.local_batch((short, {}), mesh)[0]))
    short_eval = float(pm.eval_batch(*autoshard.local_batch((short, {}), mesh)[0]))
    # ... and one of 6 rows, 3 per replica, which microbatches=2 does not divide: it runs as 1 microbatch
    odd, _ = batch("gpt", VOCAB, B=6, seed=97)
    odd_loss = float(pm.step(*autoshard.local_batch((odd, {}), mesh)[0]))
    with torch.no_grad():
        want_short = float(ref(*short))
        want_odd = float(ref(*odd))
    return dict(loss=loss, ref_loss=float(ref_loss), worst=worst, short_loss=short_loss, short_eval=short_eval,
                want_short=want_short, odd_loss=odd_loss, want_odd=want_odd)


def eval_batch_is_the_eval_mode_loss(rank, world):
    """pm.eval_batch on dp=2 x pp=2 with dropout 0.2: the single-device model's eval-mode loss on the global
    batch (no dropout), twice the same, leaving the gradients of a step before it untouched."""
    mesh = autoshard.init_mesh(dp=2, pp=2)
    model = build("gpt", vocab_size=VOCAB, n_layer=2, dropout=0.2)
    pm = autoshard.parallelize(copy.deepcopy(model), mesh, *autoshard.local_batch((_global(0), {}), mesh),
                               microbatches=2)
    pm.step(*autoshard.local_batch((_global(0), {}), mesh)[0])
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)      # no collective per comparison
    grads = {n: local(p.grad).clone() for n, p in pm.named_parameters() if p.grad is not None}
    got = [float(pm.eval_batch(*autoshard.local_batch((_global(1), {}), mesh)[0])) for _ in range(2)]
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        _, want = ref(*_global(1))
    untouched = all(torch.equal(local(p.grad), grads[n]) for n, p in pm.named_parameters() if n in grads)
    pm.max_programs = 1          # twins are bounded: a short batch's eval program replaces the first's
    short = autoshard.local_batch(([t[:4] for t in _global(1)], {}), mesh)[0]
    with torch.no_grad():
        want_short = float(ref(*[t[:4] for t in _global(1)])[1])
    bounded = [float(pm.eval_batch(*short)), float(pm.eval_batch(*autoshard.local_batch((_global(1), {}), mesh)[0]))]
    twins = len(pm.step_runners) - 1      # beside the first program's runner
    # pm.eval() then pm.step: as model.eval() then backward in torch, a step without dropout
    for p in pm.parameters():
        p.grad = None
    pm.eval()
    eval_step = float(pm.step(*autoshard.local_batch((_global(2), {}), mesh)[0]))
    ref.zero_grad()
    _, want_step = ref(*_global(2))
    want_step.backward()
    ref_grads = dict(ref.named_parameters())
    step_err = max((local(p.grad) - ref_grads[n].grad).abs().max().item() for n, p in pm.named_parameters())
    pm.train()
    return dict(got=got, want=float(want), untouched=untouched, held=bool(grads), twins=twins,
                bounded=bounded, want_bounded=[want_short, float(want)], eval_step=eval_step,
                want_eval_step=float(want_step), eval_step_grad_err=step_err)


def mixed_precision_on_the_whole_mesh(rank, world):
    """bf16 compute with fp32 parameters, gradients and ZeRO-1 state, on dp=2 x pp=2 with a tied head and
    clipping: the losses within bf16 rounding of the fp32 single-device model's, the main weights fp32."""
    from tests.harness.pipeline_checks import pipeline_parity
    return pipeline_parity(rank, world, "gpt", dict(dp=2, pp=2),
                           dict(microbatches=2, zero=1, mixed_precision="bf16", clip=0.5), dict(n_layer=2))


def mixed_precision_with_rotary_tables(rank, world):
    """bf16 on an HF Llama (tied head) at pp=2 x tp=2: the weightless bf16 twin it is traced from holds its
    rotary tables on meta, and the step must run on the model's own (a meta copy crashed every rank)."""
    from tests.harness.pipeline_checks import pipeline_parity
    return pipeline_parity(rank, world, "family", dict(pp=2, tp=2), dict(microbatches=2, mixed_precision="bf16"),
                           dict(family="llama", kv_heads=2, tie_word_embeddings=True), steps=2)


def sequence_parallel_with_accumulation(rank, world):
    """Sequence parallelism with gradient accumulation, two half batches per AdamW step, 3 steps, against
    the single-device model accumulating the same halves: the user's loop (``pm(...)`` + ``backward()``)
    at tp=4, and ``pm.step`` at dp=2 x tp=2. The norms' gradient shares are summed over tp once per
    backward, or once per step after the dp sum (``ir/partial_grads``): each call's alone, added onto
    ``.grad`` as autograd would."""
    from tests.harness.parity_checks import gradient_errors
    out = {}
    for how, dims in (("call", dict(tp=4)), ("step", dict(dp=2, tp=2))):
        mesh = autoshard.init_mesh(**dims)
        model = build("gpt", vocab_size=VOCAB, n_layer=2)
        ref = copy.deepcopy(model)
        halves = [[t[i * 4:(i + 1) * 4] for t in _global(0)] for i in range(2)]
        pm = autoshard.parallelize(copy.deepcopy(model), mesh, *autoshard.local_batch((halves[0], {}), mesh),
                                   loss_only=True, sequence_parallel=True)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-4)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
        losses, grad_err = [], 0.0
        for step in range(3):
            halves = [[t[i * 4:(i + 1) * 4] for t in _global(step)] for i in range(2)]
            got = want = 0.0
            for half in halves:
                mine = autoshard.local_batch((half, {}), mesh)[0]
                if how == "call":
                    _, loss = pm(*mine)
                    loss.backward()
                else:
                    loss = pm.step(*mine)
                _, ref_loss = ref(*half)
                ref_loss.backward()
                got, want = got + float(loss.detach()), want + float(ref_loss.detach())
            if step == 0:
                grad_err = max(gradient_errors(pm, ref).values())
                local_gather, wrong_shape, uneven = _gather_from_local_shards(pm)
            losses.append(abs(got - want) / abs(want))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out[how] = dict(losses=losses, grad_err=grad_err, local_gather=local_gather, wrong_shape=wrong_shape,
                        uneven=uneven)
    return out


def _gather_from_local_shards(pm) -> tuple:
    """``pm.gather`` of each gradient's plain local shard against the DTensor's own gather: the largest
    difference (a vocab of 97 over 4 ranks leaves the last one 22 rows where the others hold 25: its
    short chunk aborted gloo's all-gather before ``gather`` padded it), and the error a tensor of the wrong
    shape gets, before any collective."""
    worst, uneven = 0.0, 0
    for n, p in pm.named_parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            worst = max(worst, float((pm.gather(n, local) - pm.gather(n, p.grad)).abs().max()))
            # a padded shard (a last chunk shorter than the others), set against DTensor's own full_tensor:
            # the case that aborted gloo
            record = pm.params.records[n]
            dim = getattr(record.spec.tp, "dim", None)
            uneven += hasattr(p.grad, "to_local") and dim is not None and record.global_shape[dim] % pm.params.tp.size > 0
    name = next(n for n, p in pm.named_parameters() if p.dim() == 2)
    try:
        pm.gather(name, torch.zeros(3, 5))
        message = None
    except InputError as e:
        message = str(e)
    return worst, message, uneven


def _opt_with_dropout(p: float):
    """A tiny HF OPT (``tests/harness/families.py``) with its residual and attention dropouts at ``p``."""
    from tests.harness.families import FamilyConfig
    from tests.harness.families import build as build_family
    model = build_family(FamilyConfig("opt", layers=2, hidden=64, heads=4, vocab=VOCAB))
    for m in model.modules():
        for key in ("dropout", "attention_dropout"):
            if isinstance(getattr(m, key, None), float):
                setattr(m, key, p)
    return model


def _hf_batch(how: str, step: int) -> dict:
    if how == "hf opt sp":
        from tests.harness.families import batch as family_batch
        return family_batch(VOCAB, B=2, T=8, seed=10 + step)
    return _keywords(_global(step))


def dropout_on_tp_shards(rank, world):
    """Dropout 0.1 at tp=4 with sequence parallelism and manual attention: the stream's dropouts act on
    sequence shards and the attention's on head shards, and each draws the whole tensor's mask and keeps
    its part (``passes/sharded_dropout.py``), so with every rank seeded as the single device is, the
    losses, gradients and 3 AdamW steps are the model's: in the user's loop and in ``pm.step`` with 2
    microbatches (run in order: the reference steps on the same halves). Then SDPA's own ``dropout_p``
    on head shards, spelled out as ATen's math attention (``passes/sdpa_dropout.py``): the built-in GPT
    with ``flash=True`` and HF GPT-2 with ``attn_pdrop=0.1`` through SDPA, called with keywords (before
    the pass each rank drew one pattern over its heads: gradients off by 0.89 and 0.93 relative at tp=2).
    Last, HF OPT with sequence parallelism, 2 sequences (fewer than tp: the stream is sharded along the
    sequence, not the batch) with an attention mask: its MLP flattens the stream to ``[b*s, h]``, so the
    dropout after fc2 sees the sequence shard as ``b`` blocks (before the blocked case was handled it
    stayed torch's dropout on each rank's part: loss off by 0.4%, gradients by 0.73 relative at tp=2,
    by 1.14 at tp=4)."""
    from tests.harness.parity_checks import gradient_errors
    out = {}
    for how in ("call", "step", "sdpa", "hf sdpa", "hf opt sp"):
        mesh = autoshard.init_mesh(tp=4)
        if how == "hf sdpa":
            model = build("hf", vocab_size=VOCAB, attn="sdpa", attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
        elif how == "hf opt sp":
            model = _opt_with_dropout(0.1)
        else:
            model = build("gpt", vocab_size=VOCAB, n_layer=2, dropout=0.1, flash=how == "sdpa")
        model.train()
        ref = copy.deepcopy(model)
        if how.startswith("hf"):
            pm = autoshard.parallelize(copy.deepcopy(model), mesh, (), _hf_batch(how, 0), loss_only=True,
                                       sequence_parallel=how == "hf opt sp")
        else:
            pm = autoshard.parallelize(copy.deepcopy(model), mesh, _global(0), loss_only=True,
                                       sequence_parallel=how != "sdpa", **({"microbatches": 2} if how == "step" else {}))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-4)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
        losses, grad_err = [], 0.0
        for step in range(3):
            batch_ = _global(step)
            torch.manual_seed(100 + step)
            if how.startswith("hf"):
                loss = pm(**_hf_batch(how, step)).loss
                loss.backward()
            elif how != "step":
                _, loss = pm(*batch_)
                loss.backward()
            else:
                loss = pm.step(*batch_)
            torch.manual_seed(100 + step)
            if how.startswith("hf"):
                want = ref(**_hf_batch(how, step)).loss
                want.backward()
            elif how != "step":
                _, want = ref(*batch_)
                want.backward()
            else:             # the halves in order, each a mean over its own non-ignored targets
                count = [int((t != -100).sum()) for t in (batch_[1][:4], batch_[1][4:])]
                want = 0.0
                for half, n in zip(((batch_[0][:4], batch_[1][:4]), (batch_[0][4:], batch_[1][4:])), count):
                    _, part = ref(*half)
                    (part * n / sum(count)).backward()
                    want = want + part.detach() * n / sum(count)
            if step == 0:
                grad_err = max(gradient_errors(pm, ref).values())
            losses.append(abs(float(loss.detach()) - float(want.detach())) / abs(float(want.detach())))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out[how] = dict(losses=losses, grad_err=grad_err)
    return out


def suite(rank, world, path):
    return dict(mixed=mixed_precision_on_the_whole_mesh(rank, world),
                mixed_rope=mixed_precision_with_rotary_tables(rank, world),
                zero=zero_groups_scheduler_frozen_and_checkpoint(rank, world, path),
                pipeline=pipeline_frozen_tied_and_real_weights(rank, world),
                summed=summed_loss_over_microbatches_and_dp(rank, world),
                eval=eval_batch_is_the_eval_mode_loss(rank, world),
                sp=sequence_parallel_with_accumulation(rank, world),
                dropout=dropout_on_tp_shards(rank, world))
