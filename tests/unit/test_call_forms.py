"""A compiled module takes the calls its model takes: keywords in any order run the example's program, and
other keywords (``inputs_embeds=`` for ``input_ids=``) compile their own instead of being checked, by
place, against the example's inputs. One process, a mesh of one rank."""
import copy

import pytest
import torch
import transformers as T

import autoshard
from autoshard.models.gpt import GPT, GPTConfig


def _gpt2():
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=16)).eval()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 101, (2, 8), generator=g), torch.randint(0, 101, (2, 8), generator=g)
    return model, ids, labels, torch.ones(2, 8, dtype=torch.long)


def test_keywords_in_another_order_run_the_examples_program():
    model, ids, labels, mask = _gpt2()
    want = model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False).loss
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False))
    got = pm(attention_mask=mask, use_cache=False, labels=labels, input_ids=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(pm.programs) == 1
    short = labels[:, :5]
    with pytest.raises(autoshard.InputError, match=r"'labels' \(2, 5\), compiled for \(2, 8\)") as err:
        pm(attention_mask=mask, use_cache=False, labels=short, input_ids=ids)   # the labels are the short ones
    assert "'input_ids' (2, 5)" not in str(err.value)
    eval_loss = pm.eval_batch(use_cache=False, labels=labels, attention_mask=mask, input_ids=ids)
    torch.testing.assert_close(eval_loss, want, rtol=1e-5, atol=1e-6)


def test_inputs_embeds_instead_of_input_ids_compiles_its_own_program():
    model, ids, labels, mask = _gpt2()
    emb = model.transformer.wte(ids).detach()
    want = model(inputs_embeds=emb, labels=labels, use_cache=False).loss
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False))
    got = pm(inputs_embeds=emb, labels=labels, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got = pm(labels=labels, inputs_embeds=emb, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_options_make_a_forward_program_that_returns_the_mean():
    """compile_options() fills in pm.step's pipeline options; compile_rank compiles a forward, whose loss
    is the model's mean, not the microbatch rewrite's sum."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16))
    idx, tgt = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    prog = autoshard.compile_rank(gpt, {"tp": 1}, 0, (idx, tgt), options=autoshard.compile_options(loss_only=True))
    got = autoshard.ParallelModule(prog, gpt)(idx, tgt)[1]
    torch.testing.assert_close(got, gpt(idx, tgt)[1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="memory limit bounds pm.step's pipeline"):
        autoshard.compile_rank(gpt, {"tp": 1}, 0, (idx, tgt), options=autoshard.compile_options(memory_limit=1e9))


def test_a_float_example_mask_takes_a_tokenizers_int_mask():
    """torch.ones makes a float mask; a tokenizer's is int64: HF takes both, and so does the module (its
    own program), where a float inputs_embeds given as ints is still refused."""
    model, ids, labels, mask = _gpt2()
    want = model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False).loss
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, attention_mask=mask.float(), use_cache=False))
    got = pm(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(autoshard.InputError, match="'input_ids' is float32"):
        pm(input_ids=ids.float(), labels=labels, attention_mask=mask.float(), use_cache=False)


def test_inputs_whose_rows_differ_are_named_when_a_step_cannot_split_them():
    model, ids, labels, mask = _gpt2()
    ids, labels, mask = (torch.cat([t, t]) for t in (ids, labels, mask))
    pm = autoshard.parallelize(copy.deepcopy(model).train(), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, use_cache=False), microbatches=2)
    positions = torch.arange(8).unsqueeze(0)
    with pytest.raises(ValueError, match=r"first dims differ: \[1, 4\] \(input_ids \(4, 8\), labels \(4, 8\), "
                                         r"position_ids \(1, 8\)\)"):
        pm.step(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)


def test_a_position_past_the_table_names_the_position_table():
    model, ids, labels, mask = _gpt2()
    positions = torch.arange(8).repeat(2, 1)
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, position_ids=positions, use_cache=False))
    with pytest.raises(autoshard.InputError, match="of 'position_ids'.*position table has 16 rows"):
        pm(input_ids=ids, labels=labels, position_ids=positions + 10, use_cache=False)


def test_a_python_number_that_changes_every_call_is_named_with_the_fix():
    """HF's num_items_in_batch as an int is compiled in as a constant: each new value is a new program,
    which is said (naming the input and the fix, a tensor); as a tensor it is an input, one program."""
    model, ids, labels, mask = _gpt2()
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=16))
    with pytest.warns(UserWarning, match=r"'num_items_in_batch' = 15.*pass it as a tensor"):
        pm(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=15)
    tensor = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (), dict(
        input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(16)))
    want = model(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(12)).loss
    got = tensor(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(12)).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(tensor.programs) == 1


def test_a_step_whose_python_number_keeps_changing_says_so():
    model, ids, labels, mask = _gpt2()
    pm = autoshard.parallelize(copy.deepcopy(model).train(), {"tp": 1}, (),
                               dict(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=16))
    pm.step(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=15)
    with pytest.warns(UserWarning, match=r"'num_items_in_batch' = 14.*pass it as a tensor"):
        pm.step(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=14)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_labels_of_another_integer_dtype_name_the_fix(dtype):
    """torch's cross_entropy takes int64 class indices: int32 labels are refused on one device, and a
    vocab-parallel shard would take them; the module says .long() before compiling anything for them."""
    model, ids, labels, mask = _gpt2()
    pm = autoshard.parallelize(copy.deepcopy(model), {"tp": 1}, (), dict(input_ids=ids, labels=labels, use_cache=False))
    with pytest.raises(autoshard.InputError, match=r"'labels' is .*int64.*labels.long\(\)"):
        pm(input_ids=ids, labels=labels.to(dtype), use_cache=False)
