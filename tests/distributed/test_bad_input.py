"""The bad-input corpus: what torch refuses on one device, autoshard refuses on every rank.

Each case is a call a user could make by mistake, run on real gloo ranks. Every rank must raise, within
the harness's bound (a rank that hangs in a collective fails the test by timeout), with an exception
that is not an internal type and whose first line names the cause. The table below is the corpus; the
closing note of issue 24 lists each case with its error's first line (``python -m tests.distributed.test_bad_input``
prints them).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import pytest
import torch

import autoshard
from tests.harness.distributed import run_distributed
from tests.harness.models import batch, build

INTERNAL = ("KeyError", "AttributeError", "IndexError", "TypeError", "AssertionError", "UnboundLocalError",
            "NameError", "ZeroDivisionError", "StopIteration", "NotImplementedError", "EOFError",
            "UnpicklingError")
GPT_VOCAB, HF_VOCAB = 97, 101


@dataclass
class Case:
    """``run(rank, world, tmp)`` makes one bad call; ``cause`` must match the error's first line."""
    name: str
    run: object
    cause: str
    meshes: tuple = ("tp2",)
    options: dict = field(default_factory=dict)


MESHES = {"tp1": dict(tp=1), "tp2": dict(tp=2), "tp4": dict(tp=4), "pp2": dict(pp=2), "dp2": dict(dp=2)}


def _world(mesh: str) -> int:
    return max(1, int(MESHES[mesh].get("tp", 1)) * int(MESHES[mesh].get("pp", 1)) * int(MESHES[mesh].get("dp", 1)))


# --- building blocks -------------------------------------------------------------------------------------
def _gpt(mesh, **options):
    """A small GPT (vocab 97: padded shards at tp=2 and 4) and its pm on ``mesh``; pm.step at pp > 1."""
    model = build("gpt", vocab_size=GPT_VOCAB, block_size=16)
    (idx, tgt), _ = batch("gpt", GPT_VOCAB, B=4)
    device_mesh = autoshard.init_mesh(**MESHES[mesh])
    if MESHES[mesh].get("pp", 1) > 1 or MESHES[mesh].get("dp", 1) > 1:
        options.setdefault("microbatches", 2)
    pm = autoshard.parallelize(model, device_mesh, (idx, tgt), loss_only=True, **options)
    return pm, idx, tgt


def _train(pm, idx, tgt):
    """What a user's loop runs: pm.step on a pipeline or with dp, else pm(...) + backward."""
    if pm.comms["pp"].size > 1 or pm.comms["dp"].size > 1:
        return pm.step(idx, tgt)
    loss = pm(idx, tgt)[1]
    loss.backward()
    return loss


def _hf(mesh="tp2", **example):
    model = build("hf", vocab_size=HF_VOCAB)
    _, kw = batch("hf", HF_VOCAB, B=2, T=8)
    kw.update(attention_mask=torch.ones_like(kw["input_ids"]), use_cache=False)
    kw.update(example)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (), kw, loss_only=True)
    return pm, kw


# --- the cases ---------------------------------------------------------------------------------------------
def _one_bad_value(which: str, position: tuple, value: int, rank: int | None = None, evaluate: bool = False):
    """A case: the GPT's batch with one entry of the ids (``which="idx"``) or labels set to ``value`` (on
    ``rank`` only, when given: each dp replica its own rows), then a training step or ``eval_batch``."""
    def run(mesh, tmp, **options):
        pm, idx, tgt = _gpt(mesh, **options)
        batch_ = {"idx": idx.clone(), "tgt": tgt.clone()}
        if rank is None or torch.distributed.get_rank() == rank:
            batch_[which][position] = value
        if evaluate:
            pm.eval_batch(batch_["idx"], batch_["tgt"])
        else:
            _train(pm, batch_["idx"], batch_["tgt"])
    return run


label_too_large = _one_bad_value("tgt", (1, 3), 1500)
label_negative = _one_bad_value("tgt", (0, 5), -7)
id_too_large = _one_bad_value("idx", (2, 1), 5000)
id_negative = _one_bad_value("idx", (0, 0), -1)
# each replica its own rows, one of them with a bad value: every replica stops before the gradients' all-reduce
label_too_large_on_one_replica = _one_bad_value("tgt", (2, 3), 1500, rank=1)
id_too_large_in_eval_on_one_replica = _one_bad_value("idx", (1, 1), 5000, rank=0, evaluate=True)


def float_ids(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    _train(pm, idx.float(), tgt)


def int_embeds(mesh, tmp):
    model = build("hf", vocab_size=HF_VOCAB)
    embeds = torch.randn(2, 8, 32)
    labels = torch.randint(0, HF_VOCAB, (2, 8))
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (),
                               dict(inputs_embeds=embeds, labels=labels, use_cache=False), loss_only=True)
    pm(inputs_embeds=embeds.long(), labels=labels, use_cache=False).loss.backward()


def labels_of_another_shape(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    _train(pm, idx, torch.cat([tgt, tgt[:, :1]], dim=1))


def hf_label_too_large(mesh, tmp):
    """HF's loss pads the labels with ignore_index and shifts them: still the labels' own values."""
    if MESHES[mesh].get("pp", 1) > 1:
        model = build("hf", vocab_size=HF_VOCAB)
        _, kw = batch("hf", HF_VOCAB, B=4, T=8)
        pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (), kw, microbatches=2)
        kw["labels"][3, 2] = 777
        pm.step(**kw)
        return
    pm, kw = _hf(mesh)
    kw["labels"] = kw["labels"].clone()
    kw["labels"][1, 2] = 777
    pm(**kw).loss.backward()


def hf_labels_of_another_shape(mesh, tmp):
    pm, kw = _hf(mesh)
    kw = dict(kw, labels=kw["labels"][:, :5])
    pm(**kw).loss.backward()


def mask_of_wrong_length(mesh, tmp):
    pm, kw = _hf(mesh)
    kw = dict(kw, attention_mask=kw["attention_mask"][:, :6])
    pm(**kw).loss.backward()


def sequence_longer_than_positions(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    long = torch.randint(0, GPT_VOCAB, (4, 40))
    _train(pm, long, long)


def hf_sequence_longer_than_positions(mesh, tmp):
    pm, kw = _hf(mesh)
    ids = torch.randint(0, HF_VOCAB, (2, 40))
    pm(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), use_cache=False).loss.backward()


def no_loss_with_loss_only(mesh, tmp):
    model = build("hf", vocab_size=HF_VOCAB)
    ids = torch.randint(0, HF_VOCAB, (2, 8))
    autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (), dict(input_ids=ids, use_cache=False),
                          loss_only=True)


def missing_argument(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    pm(idx)


def rows_differ_per_dp_rank(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    rank = torch.distributed.get_rank()
    rows = 4 if rank == 0 else 2
    pm.step(idx[:rows], tgt[:rows])


def sequence_differs_per_dp_rank(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    cols = 8 if torch.distributed.get_rank() == 0 else 6
    pm.step(idx[:, :cols], tgt[:, :cols])


def inputs_embeds_after_input_ids(mesh, tmp):
    """A pipeline built on input_ids, stepped with inputs_embeds: stage 0 would not read the embedding."""
    model = build("hf", vocab_size=HF_VOCAB)
    _, kw = batch("hf", HF_VOCAB, B=4, T=8)
    kw.update(use_cache=False)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (), kw, microbatches=2)
    embeds = torch.randn(4, 8, 32)
    kw.pop("input_ids")
    pm.step(inputs_embeds=embeds, **kw)


def eval_batch_without_labels(mesh, tmp):
    model = build("hf", vocab_size=HF_VOCAB)
    _, kw = batch("hf", HF_VOCAB, B=4, T=8)
    kw.update(use_cache=False)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (), kw, microbatches=2)
    kw.pop("labels")
    pm.eval_batch(**kw)


def _saved(mesh, tmp, **cfg):
    """A checkpoint of a GPT (``cfg`` changes its config) saved on ``mesh``: the path."""
    model = build("gpt", vocab_size=GPT_VOCAB, block_size=16, **cfg)
    (idx, tgt), _ = batch("gpt", GPT_VOCAB, B=4)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (idx, tgt), loss_only=True)
    path = os.path.join(tmp, "ckpt")
    autoshard.save(pm, None, path, step=1)
    return path


def checkpoint_of_another_model(mesh, tmp):
    path = _saved(mesh, tmp, bias=False)             # no biases: the loading model's biases are missing
    pm, idx, tgt = _gpt(mesh)
    autoshard.load(pm, None, path)


def checkpoint_of_other_shapes(mesh, tmp):
    path = _saved(mesh, tmp, n_embd=48)
    pm, idx, tgt = _gpt(mesh)
    autoshard.load(pm, None, path)


def checkpoint_with_extra_entries(mesh, tmp):
    path = _saved(mesh, tmp)                          # with biases: the loading model has none
    model = build("gpt", vocab_size=GPT_VOCAB, block_size=16, bias=False)
    (idx, tgt), _ = batch("gpt", GPT_VOCAB, B=4)
    pm = autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (idx, tgt), loss_only=True)
    autoshard.load(pm, None, path)


def mesh_that_does_not_divide_the_heads(mesh, tmp):
    model = build("gpt", vocab_size=GPT_VOCAB, block_size=16, n_head=2)
    (idx, tgt), _ = batch("gpt", GPT_VOCAB, B=4)
    autoshard.parallelize(model, autoshard.init_mesh(**MESHES[mesh]), (idx, tgt), loss_only=True)


def truncated_checkpoint(mesh, tmp):
    path = _saved(mesh, tmp)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        for name in os.listdir(path):
            if name.endswith(".distcp"):
                full = os.path.join(path, name)
                with open(full, "r+b") as f:
                    f.truncate(os.path.getsize(full) // 3)
    torch.distributed.barrier()
    pm, idx, tgt = _gpt(mesh)
    autoshard.load(pm, None, path)


def full_state_dict_of_other_shapes(mesh, tmp):
    pm, idx, tgt = _gpt(mesh)
    other = build("gpt", vocab_size=GPT_VOCAB + 8, block_size=16)
    pm.load_full_state_dict(other.state_dict())


def nan_loss_with_check_finite(mesh, tmp):
    pm, idx, tgt = _gpt(mesh, check_finite=True)
    with torch.no_grad():
        for p in pm.parameters():
            p.fill_(float("nan"))
            break
    _train(pm, idx, tgt)


def nan_loss_with_env(mesh, tmp):
    os.environ["AUTOSHARD_CHECK_FINITE"] = "1"
    try:
        pm, idx, tgt = _gpt(mesh)
        with torch.no_grad():
            next(iter(pm.parameters())).fill_(float("inf"))
        _train(pm, idx, tgt)
    finally:
        del os.environ["AUTOSHARD_CHECK_FINITE"]


SILENT = ("tp1", "tp2", "tp4", "pp2")
CASES = [
    Case("a label >= vocab", label_too_large, r"label 1500 at position \(\d+(, \d+)?\).*outside \[0, 97\)", SILENT),
    Case("a label >= vocab, chunked LM head + loss", label_too_large, r"label 1500 .*outside \[0, 97\)",
         ("tp1", "tp2"), dict(loss_chunk_rows=4)),
    Case("a negative label other than ignore_index", label_negative, r"label -7 .*outside \[0, 97\) or ignore_index=-100",
         SILENT),
    Case("a token id >= vocab", id_too_large, r"token id 5000 at position \(2, 1\).*outside \[0, 97\)", SILENT),
    Case("a negative token id", id_negative, r"token id -1 at position \(0, 0\).*outside \[0, 97\)", ("tp2", "pp2")),
    Case("float token ids", float_ids, r"float32.*int64|int64.*float32"),
    Case("int64 inputs_embeds (a float input)", int_embeds, r"inputs_embeds.*int64.*float32"),
    Case("labels of another shape than the ids", labels_of_another_shape, r"targets.*\(4, 9\)|\(4, 9\).*targets"),
    Case("HF: a label >= vocab", hf_label_too_large, r"label 777 at position \(\d, 2\) of 'labels'", ("tp2", "pp2")),
    Case("HF labels of another shape", hf_labels_of_another_shape, r"labels.*\(2, 5\)|\(2, 5\).*labels"),
    Case("an attention mask of the wrong length", mask_of_wrong_length, r"attention_mask.*\(2, 6\)|\(2, 6\).*attention_mask"),
    Case("a sequence longer than the position table", sequence_longer_than_positions, r"\(4, 40\).*16 rows",
         ("tp2", "pp2")),
    Case("HF: a sequence longer than n_positions", hf_sequence_longer_than_positions, r"\(2, 40\).*16 rows"),
    Case("loss_only=True and the model returns no loss", no_loss_with_loss_only, r"loss_only=True.*no loss|labels="),
    Case("a missing argument (no targets, loss_only=True)", missing_argument, r"no loss.*targets|labels"),
    Case("another row count on each dp rank", rows_differ_per_dp_rank, r"rows.*dp", ("dp2",)),
    Case("another sequence length on each dp rank", sequence_differs_per_dp_rank,
         r"the same \d+ rows each, but another dimension differs, such as the sequence length", ("dp2",)),
    Case("a label >= vocab on one dp replica only", label_too_large_on_one_replica,
         r"label 1500 at position \(2, 3\)|dp replica 1 of 2 .*out of range", ("dp2",)),
    Case("a token id >= vocab in eval_batch on one dp replica only", id_too_large_in_eval_on_one_replica,
         r"token id 5000 at position \(1, 1\)|dp replica 0 of 2 .*out of range", ("dp2",)),
    Case("inputs_embeds= in a pipeline built on input_ids=", inputs_embeds_after_input_ids,
         r"other parameters on stage 0 .*leaves \['transformer.wte.weight'\] unread", ("pp2",)),
    Case("eval_batch without labels on a pipeline", eval_batch_without_labels,
         r"pm.eval_batch run from the model's loss.*labels=.*returns no logits", ("pp2",)),
    Case("a checkpoint of another model", checkpoint_of_another_model, r"missing.*bias"),
    Case("a checkpoint of other shapes", checkpoint_of_other_shapes, r"shape.*48|48.*shape"),
    Case("a checkpoint with entries the model lacks", checkpoint_with_extra_entries, r"unexpected.*bias"),
    Case("a mesh that does not divide the heads", mesh_that_does_not_divide_the_heads, r"2 heads.*tp=4", ("tp4",)),
    Case("a truncated checkpoint file", truncated_checkpoint, r"truncated|corrupt|could not read"),
    Case("a full state dict of other shapes", full_state_dict_of_other_shapes, r"shape \(105, 32\).*\(97, 32\)"),
    Case("a NaN loss with check_finite", nan_loss_with_check_finite, r"step \d+.*non-finite"),
    Case("a NaN loss with AUTOSHARD_CHECK_FINITE=1", nan_loss_with_env, r"step \d+.*non-finite", ("pp2",)),
]


def _run_case(rank, case_index, mesh) -> dict:
    case = CASES[case_index]
    tmp = os.path.join(tempfile.gettempdir(), f"autoshard_badinput_{os.getppid()}_{case_index}_{mesh}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    torch.distributed.barrier()
    start = time.perf_counter()
    try:
        case.run(mesh, tmp, **case.options)
    except Exception as e:  # noqa: BLE001 - what the user would see
        first = (str(e).strip().splitlines() or [""])[0]
        return dict(raised=type(e).__name__, first=first, seconds=time.perf_counter() - start)
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return dict(raised=None, first="", seconds=time.perf_counter() - start)


def _run_mesh(rank, world, mesh):
    """Every case of ``mesh`` in one process group, one after the other (each builds its own pm)."""
    os.environ["AUTOSHARD_TIMEOUT"] = "30"      # a hung collective fails in seconds, not minutes
    return {i: _run_case(rank, i, mesh) for i, c in enumerate(CASES) if mesh in c.meshes}


@functools.lru_cache(maxsize=None)
def results_for(mesh: str) -> list:
    """Per rank, ``{case index: result}`` for every case on ``mesh`` (one launch per mesh)."""
    return run_distributed(_run_mesh, _world(mesh), mesh, timeout=600, fresh=True)   # a case may time a group out


PARAMS = [pytest.param(i, m, id=f"{c.name} [{m}]") for i, c in enumerate(CASES) for m in c.meshes]


@pytest.mark.parametrize("case_index, mesh", PARAMS)
def test_bad_input_is_a_clear_error_on_every_rank(case_index, mesh):
    case = CASES[case_index]
    for rank, per_case in enumerate(results_for(mesh)):
        r = per_case[case_index]
        assert r["raised"] is not None, f"rank {rank}: {case.name} gave no error"
        assert r["raised"] not in INTERNAL, f"rank {rank}: {case.name} raised an internal {r['raised']}: {r['first']}"
        assert re.search(case.cause, r["first"]), f"rank {rank}: {case.name}: the first line does not name the " \
                                                  f"cause: {r['raised']}: {r['first']}"


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama", "falcon"])
def test_the_compiler_finds_the_ids_and_labels_of_hf_models(family):
    """HF's loss pads the labels with ignore_index, shifts and casts them: still found as the labels."""
    from tests.harness import families
    cfg = families.FamilyConfig(family=family)
    prog = autoshard.compile_rank(families.build(cfg), {"tp": 2}, 0, (), families.batch(cfg.vocab))
    found = {(r.input, r.what, r.size, r.ignore_index) for r in prog.captured.index_ranges}
    assert ("input_ids", "token id", cfg.vocab, None) in found and ("labels", "label", cfg.vocab, -100) in found, found


if __name__ == "__main__":   # the table of every case's first line (for the closing note)
    for i, c in enumerate(CASES):
        for m in c.meshes:
            r = results_for(m)[0][i]
            print(f"| {c.name} | {m} | {r['raised']}: {r['first']} |")
