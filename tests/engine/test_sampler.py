"""top_k_top_p and sampling_probs against a row-by-row oracle written from the filter's definition
(one full sort of each row)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollwise.engine import sampler
from rollwise.engine.sampler import sampling_probs, top_k_top_p

NEG = float("-inf")


def oracle(row: torch.Tensor, k: int, p: float, m: float) -> torch.Tensor:
    """The tokens one row keeps: min-p, then the logits at least the k-th largest, then the tokens at
    least as likely as the nucleus's last (the last, best first, whose mass before it is below p)."""
    keep = torch.isfinite(row)
    if m > 0:
        probs = torch.softmax(row, -1)
        keep &= probs >= m * probs.max()
    x = row.masked_fill(~keep, NEG)
    if 0 < k < len(row):
        keep &= x >= x.sort(descending=True).values[k - 1]
    if p < 1:
        probs = torch.softmax(x.masked_fill(~keep, NEG), -1)
        desc = probs.sort(descending=True).values.numpy()
        before = np.cumsum(desc, dtype=np.float64).astype(np.float32) - desc
        last = max(i for i in range(len(desc)) if before[i] < np.float32(p))
        keep &= probs >= float(desc[last])
    return keep


def kept(logits: torch.Tensor, ks, ps, ms=None) -> torch.Tensor:
    """top_k_top_p's kept tokens, after checking that sampling_probs draws from them in proportion."""
    filtered = top_k_top_p(logits, ks, ps, ms)
    probs = sampling_probs(logits, ks, ps, ms)
    assert torch.allclose(probs / probs.sum(-1, keepdim=True), torch.softmax(filtered, -1), rtol=1e-5, atol=1e-12)
    assert not (probs[~torch.isfinite(filtered)] > 0).any()
    return torch.isfinite(filtered)


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])  # flat (the nucleus is most of the row) to peaked
def test_matches_the_oracle_at_every_rung(monkeypatch, scale):
    monkeypatch.setattr(sampler, "NUCLEUS_FIRST", 8)  # the top 8, then the whole row
    g = torch.Generator().manual_seed(int(scale * 100))
    vocab = 5000
    logits = torch.randn(12, vocab, generator=g) * scale
    logits[3, 100:] = NEG  # a row with 100 candidates
    logits[4, 1:] = NEG  # one candidate
    logits[5, :4000] = NEG
    ks = [0, 0, 50, 0, 0, 20, 7, 0, vocab, 3000, 0, 1]
    ps = [0.9, 0.5, 0.95, 0.99, 0.3, 1.0, 0.8, 0.999, 0.7, 0.9, 1e-6, 0.9]
    ms = [0.0] * 8 + [0.0, 0.0, 0.2, 0.0]
    got = kept(logits, ks, ps, ms)
    for i in range(len(ks)):
        want = oracle(logits[i], ks[i], ps[i], ms[i])
        assert torch.equal(got[i], want), (i, int(got[i].sum()), int(want.sum()))
        alone = kept(logits[i:i + 1], ks[i:i + 1], ps[i:i + 1], ms[i:i + 1])[0]
        assert torch.equal(alone, want), i  # a row's set does not depend on the rest of the batch
    assert got[4].sum() == 1 and got[11].sum() == 1 and got[10].sum() == 1


def test_top_k_rows_find_their_nucleus_in_their_top_k(monkeypatch):
    """Where every top-p row also has a top-k, its nucleus is read from the top-k's ids (no top-256);
    a row whose k-th logit is tied past the top-k's ids still gets its whole nucleus (a sort)."""
    sorts = []
    monkeypatch.setattr(sampler, "descending", lambda x: sorts.append(len(x)) or x.sort(-1, descending=True).values)
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 2
    logits[2, :30] = 10.0  # 30 tokens tied for first: top_k 20 keeps all 30
    ks, ps = [20, 5, 20, 3], [0.95, 0.5, 0.999, 0.9]
    got = kept(logits, ks, ps)
    for i in range(4):
        assert torch.equal(got[i], oracle(logits[i], ks[i], ps[i], 0.0)), i
    assert got[2].sum() == 30 and sorts == [1, 1]  # only the tied row sorted (by each of the two functions)
    kept(logits[:2], ks[:2], ps[:2])
    assert sorts == [1, 1]


def test_ties_at_the_boundary_are_kept():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, NEG]])
    assert kept(logits, [2], [1.0]).tolist() == [[True, True, True, True, False, False]]
    # probabilities 0.4, 0.2, 0.2, 0.2: the nucleus for p = 0.5 ends at the first 0.2, and its ties stay
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    assert kept(probs.log(), [0], [0.5]).tolist() == [[True, True, True, True]]
    assert kept(probs.log(), [0], [0.4]).tolist() == [[True, False, False, False]]


def test_unfiltered_rows_keep_a_tail_whose_mass_rounds_to_one():
    """With top_p = 1 a row keeps every finite token, even where float32's running sum has reached 1
    before the row ends (the sort-based filter this replaced cut those when another row used top_p)."""
    row = torch.full((1, 1000), -30.0)
    row[0, 0] = 10.0  # the rest have probability ~1e-17: their mass before is 1.0 in float32
    logits = torch.cat([row, torch.randn(1, 1000)])
    out = top_k_top_p(logits, [0, 0], [1.0, 0.5])
    assert torch.isfinite(out[0]).all()
    assert torch.equal(out[0], logits[0]) and not torch.isfinite(out[1]).all()


def test_nothing_to_filter_returns_the_logits():
    logits = torch.randn(3, 50)
    assert top_k_top_p(logits, [0, 50, 99], [1.0, 1.0, 1.0]) is logits


def test_argmax_is_torchs_first_largest():
    x = torch.randn(6, 3000, generator=torch.Generator().manual_seed(1))
    x[1, [5, 700, 2999]] = 50.0  # ties: the first
    x[2] = NEG
    x[3, [9, 40]] = float("nan")  # a NaN counts as largest: the first
    x[4, :] = 0.0
    x[5, -1] = float("inf")
    for t in (x, x[:, ::2], x[::2]):  # strided views too
        assert torch.equal(sampler.argmax(t), t.argmax(dim=-1))
    assert sampler.argmax(x).tolist()[:5] == [int(x[0].argmax()), 5, 0, 9, 0]


def test_emitted_tokens_carry_their_rank_in_the_vocabulary():
    """Each row that asks for logprobs gets its token's rank among all V as vLLM counts it (how many
    entries are at least as likely, itself included), sampled, forced or verified; a row that asks for
    none gets no top logprobs. A tie counts the tied token; a token in the top k keeps its rank there."""
    from rollwise.engine.sampler import SampleRow, Sampler
    from rollwise.engine.verification import verify
    from rollwise.sampling import SamplingParams
    from rollwise.types import Draft
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 2
    logits[4, 7] = logits[4, 9] = logits[4].max() - 0.5  # a tie: both count
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=1, logprobs=2), 3),
            SampleRow(SamplingParams(temperature=0.7, seed=2, logprobs=1), 3),
            SampleRow(SamplingParams(temperature=1.0, logprob_token_ids=[4, 5]), 3),
            SampleRow(SamplingParams(temperature=1.0, seed=3), 3),  # asks for none
            SampleRow(SamplingParams(temperature=0, logprobs=1), 3, forced=9)]
    temps = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.0])[:, None]
    lp = torch.log_softmax(logits / temps, -1)
    toks, lps, tops = Sampler(0)(logits.clone(), rows)
    assert tops[3] is None and toks[4] == 9
    for i in (0, 1, 2, 4):
        assert tops[i].rank == int((lp[i] >= lp[i, toks[i]]).sum()) >= 1
    assert tops[4].rank == int((logits[4] > logits[4, 9]).sum()) + 2  # (9 and 7 tied)
    assert [top.rank for top in tops if top] != [1] * 4  # (some sampled below the top)
    draft = Draft([int(lp[0].argmax()), 11], [-1, 0], [0.9, 0.9], 1.8, 2, "x")
    v = verify(logits[:3].clone(), draft, SamplingParams(temperature=1.0, logprobs=1), 0, None,
               torch.Generator().manual_seed(4))
    rows_lp = torch.log_softmax(logits[:3], -1)
    for row, (t, top) in enumerate(zip(v.tokens, v.top)):  # the rows the tokens came from: 0, then each accepted
        r = 0 if row == 0 else v.accepted[row - 1] + 1
        assert top.rank == int((rows_lp[r] >= rows_lp[r, t]).sum())
