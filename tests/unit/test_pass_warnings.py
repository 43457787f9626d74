"""A pass's warnings point at the user's line (their ``parallelize`` / ``compile_rank`` call), not at
the pass that raised them (``ir.errors.warn_user``), and obey the user's warning filters: shown once per
line by default, an error under an error filter."""
import warnings

import pytest
import torch

import autoshard
from autoshard.ir.mesh import MeshSpec
from autoshard.models import GPT, GPTConfig


def _dropout_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=96, dropout=0.1))


def test_a_pass_warning_names_the_callers_line():
    x = torch.randint(0, 96, (2, 8))
    with pytest.warns(UserWarning, match="dropout") as record:
        autoshard.compile_rank(_dropout_gpt(), MeshSpec(tp=2), 0, (x, x))
    assert {w.filename for w in record if "dropout" in str(w.message)} == {__file__}


def test_a_pass_warning_obeys_an_error_filter():
    x = torch.randint(0, 96, (2, 8))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dropout")
        with pytest.raises(UserWarning, match="dropout"):
            autoshard.compile_rank(_dropout_gpt(), MeshSpec(tp=2), 0, (x, x))


def test_a_pass_warning_is_shown_once_per_line_by_default():
    x = torch.randint(0, 96, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            autoshard.compile_rank(_dropout_gpt(), MeshSpec(tp=2), 0, (x, x))
    assert len([w for w in caught if "dropout in" in str(w.message)]) == 1
