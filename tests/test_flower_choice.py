"""A Flower node's final choice (``fedpriv_flwr.choice.keep_best``): the better of its own
linear model on raw inputs and the shared personal model, or a mix, by cross-validation on its
own training rows, as fedpriv's ``final-choice = "best"``."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedpriv.algorithms.deep.head_fit import cross_validated_heads
from fedpriv_flwr.choice import MIX_WEIGHTS, Kept, keep_best
from fedpriv_flwr.personal import STATE_KEY


def _context(schedule: str = "fedrep") -> Context:
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    context.state[STATE_KEY] = ConfigRecord({"pattern": r"^2\.", "schedule": schedule,
                                             "kind": "evaluate", "message-type": "evaluate",
                                             "source": "state"})
    return context


def _xor_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels no linear model of the raw inputs tells apart (XOR of the signs of x0 and x1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()


def _xor_body() -> torch.nn.Sequential:
    """A body whose features are |x0 + x1| and |x0 - x1| (split in ReLU halves): XOR is linear
    in them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1., 1, 0, 0], [-1, -1, 0, 0], [1, -1, 0, 0],
                                            [-1, 1, 0, 0]]) * 3)
        model[0].bias.zero_()
        model[2].weight.zero_()
        model[2].bias.zero_()
    return model


def test_the_weights_are_fedprivs():
    from fedpriv.algorithms.shared_params import MIX_WEIGHTS as FEDPRIV

    assert MIX_WEIGHTS == FEDPRIV


@pytest.mark.parametrize("schedule", ["fedrep", "finetune"])
def test_a_node_keeps_the_shared_model_where_its_features_are_what_the_labels_need(schedule):
    x, y = _xor_rows(80, 0)
    model = _xor_body()
    kept = keep_best(model, _context(schedule), (x, y))
    assert kept.weight == 1.0
    fresh, labels = _xor_rows(400, 1)
    with torch.no_grad():  # the shared model itself, as log-probabilities
        assert torch.allclose(kept(fresh), torch.log_softmax(model(fresh), -1))
        assert (kept(fresh).argmax(1) == labels).float().mean() > 0.9
        assert float(model[2].weight.abs().sum()) > 0  # the head was fitted on the node's rows


def test_a_node_keeps_its_own_model_where_the_shared_body_says_nothing():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 2] > 0).long()  # linear in the raw inputs; the body below reads only x0, x1
    model = _xor_body()
    with torch.no_grad():
        model[0].weight.zero_()  # every feature constant: the shared model is the label prior
    kept = keep_best(model, _context(), (x, y))
    assert kept.weight == 0.0
    fresh = torch.randn(300, 4, generator=g)
    with torch.no_grad():
        probs = kept.local_probs(fresh)
        assert torch.allclose(kept(fresh), torch.log(probs), atol=1e-5)
        assert (kept(fresh).argmax(1) == (fresh[:, 2] > 0).long()).float().mean() > 0.9
    assert isinstance(kept, Kept) and kept.classes == 2
    # the rule's strictness is fedpriv's choice-std-errors: 0 keeps the least loss; a huge one
    # keeps the shared model unless the local model wins on every row by the same margin
    assert keep_best(_zeroed_body(), _context(), (x, y), std_errors=0.0).weight == 0.0
    assert keep_best(_zeroed_body(), _context(), (x, y), std_errors=1e6).weight == 1.0


def _zeroed_body() -> torch.nn.Sequential:
    model = _xor_body()
    with torch.no_grad():
        model[0].weight.zero_()
    return model


def test_each_row_is_scored_by_heads_that_never_saw_it():
    """Cross-validation: changing the labels of fold 0's rows leaves the held-out predictions
    of fold 0 unchanged (they come from heads fitted on the other folds) and changes others."""
    g = torch.Generator().manual_seed(5)
    inputs = torch.randn(1, 20, 3, generator=g)
    y = torch.randint(0, 3, (1, 20), generator=g)
    mask = torch.ones(1, 20)
    held, _ = cross_validated_heads(inputs, y, mask, 3, 30, 1.0, 5, None, True)
    flipped = y.clone()
    flipped[0, ::5] = (flipped[0, ::5] + 1) % 3  # fold 0: rows 0, 5, 10, 15
    again, _ = cross_validated_heads(inputs, flipped, mask, 3, 30, 1.0, 5, None, True)
    assert torch.allclose(held[0, ::5], again[0, ::5])
    assert not torch.allclose(held[0, 1::5], again[0, 1::5])


def test_too_few_folds_and_a_train_handler_are_refused():
    x, y = _xor_rows(10, 0)
    with pytest.raises(ValueError, match="folds >= 2"):
        keep_best(_xor_body(), _context(), (x, y), folds=1)
    with pytest.raises(ValueError, match="std_errors"):
        keep_best(_xor_body(), _context(), (x, y), std_errors=-0.5)
    train = _context()
    train.state[STATE_KEY]["kind"] = "train"
    with pytest.raises(ValueError, match="evaluate handler"):
        keep_best(_xor_body(), train, (x, y))


def test_a_mix_is_the_log_linear_pool_of_the_two_models_and_each_output_normalised():
    x, _ = _xor_rows(30, 4)
    model = _xor_body()
    g = torch.Generator().manual_seed(6)
    local = torch.randn(2 * 4 + 2, generator=g)
    for w in MIX_WEIGHTS:
        kept = Kept(model, local, 2, w)
        with torch.no_grad():
            out = kept(x)
            logits = w * torch.log_softmax(model(x), -1) + (1 - w) * torch.log_softmax(
                kept.local_logits(x), -1)  # the interpolation of the two models' logits
        assert torch.allclose(out, torch.log_softmax(logits, -1), atol=1e-5), w
        assert torch.allclose(out.logsumexp(-1), torch.zeros(30), atol=1e-5), w
    assert "local" in dict(kept.named_buffers())  # moves with .to() and is in state_dict


def test_the_nodes_own_model_is_fedprivs_accelerated_local_fit():
    from fedpriv.algorithms.deep.head_fit import fit_heads

    g = torch.Generator().manual_seed(8)
    x = torch.rand(40, 4, generator=g)  # positive inputs, like pixels
    y = (x[:, 0] > x[:, 1]).long()
    kept = keep_best(_xor_body(), _context(), (x, y))
    rows = torch.ones(1, 40)
    assert torch.allclose(kept.get_buffer("local"),
                          fit_heads(x[None], y[None], rows, 2, 100, 1.0, accelerated=True)[0])
    assert not torch.allclose(kept.get_buffer("local"),
                              fit_heads(x[None], y[None], rows, 2, 100, 1.0)[0])


def test_pooled_refuses_a_weight_shape_it_would_broadcast_by_rows():
    from fedpriv.algorithms.deep.head_fit import pooled

    probs = torch.full((3, 3), 1 / 3)  # one user's (rows, classes), without the user axis
    with pytest.raises(ValueError, match="one weight"):
        pooled(torch.tensor([1.0, 0.5, 0.0]), probs, probs)


def test_a_shuffled_dataloader_in_batches_gives_the_pair_s_choice():
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _xor_rows(64, 7)
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(x, y), batch_size=10, shuffle=True)
    a, b = _xor_body(), _xor_body()
    kept_pair = keep_best(a, _context(), (x, y))
    kept_loader = keep_best(b, _context(), loader)
    assert kept_pair.weight == kept_loader.weight == 1.0  # rows in another order, same choice


def test_fit_head_takes_batches_of_inputs_of_different_sizes():
    """Only keep_best reads the raw inputs: fit_head on padded text batches of two lengths."""
    from fedpriv_flwr.heads import fit_head

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 4)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, tokens):
            return self.head(self.emb(tokens).mean(1))

    g = torch.Generator().manual_seed(8)
    batches = [(torch.randint(0, 20, (6, length), generator=g), torch.randint(0, 2, (6,),
                                                                             generator=g))
               for length in (5, 9)]
    assert fit_head(Bag(), ["head.weight", "head.bias"], batches, steps=5) > 0


@pytest.mark.parametrize("schedule", ["fedrep", "finetune"])
def test_the_shared_model_kept_is_the_one_fit_personal_fits(schedule):
    """``keep_best`` leaves the model's head as ``fit_personal`` would (from the head the node
    has), so a node that keeps the shared model keeps what it would have without the choice."""
    from fedpriv_flwr.personal import fit_personal

    x, y = _xor_rows(50, 2)
    chosen, plain = _xor_body(), _xor_body()
    with torch.no_grad():
        for m in (chosen, plain):  # a head the node already has
            m[2].weight.copy_(torch.tensor([[0.3, -0.2, 0.1, 0.0], [0.0, 0.1, -0.3, 0.2]]))
    keep_best(chosen, _context(schedule), (x, y), steps=40)
    fit_personal(plain, _context(schedule), (x, y), steps=40)
    for a, b in zip(chosen.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
