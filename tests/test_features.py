"""Tests of opd/selection/selectors.py's Eq. 5 selector features and the running normalizer of Appendix A.2."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from opd.selection.selectors import FEATURE_NAMES, RunningNormalizer, masked_quantile, rollout_features
from opd.selection.state import load_normalizer_state, normalizer_state

F64 = torch.float64


def ragged(n: int, T: int, seed: int, lengths=None):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, T, generator=g, dtype=F64) * 3
    if lengths is None:
        lengths = torch.randint(0, T + 1, (n,), generator=g).tolist()
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return values, mask, lengths, g


# ----------------------------------------------------------------------------- masked_quantile


@pytest.mark.parametrize("q", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_masked_quantile_matches_numpy_linear(q):
    values, mask, lengths, _ = ragged(8, 13, seed=1, lengths=[13, 1, 2, 5, 10, 11, 7, 3])
    # Scatter the mask (not only a prefix) for some rows.
    mask[4] = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    got = masked_quantile(values, mask, q)
    want = [float(np.quantile(values[i][mask[i]].numpy(), q, method="linear")) for i in range(8)]
    assert_close(got, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-12)


def test_masked_quantile_empty_row_is_zero_and_float32_rows():
    values, mask, _, _ = ragged(4, 9, seed=2, lengths=[0, 9, 0, 4])
    got = masked_quantile(values.float(), mask, 0.9)
    assert got[0] == 0.0 and got[2] == 0.0
    for i in (1, 3):
        want = np.quantile(values[i][mask[i]].numpy(), 0.9)
        assert abs(float(got[i]) - want) < 1e-5
    # Masked entries do not influence the value, whatever they hold.
    v2 = values.clone()
    v2[~mask] = 1e6
    assert torch.equal(masked_quantile(v2, mask, 0.9), masked_quantile(values, mask, 0.9))


def test_masked_quantile_hand_example():
    values = torch.tensor([[4.0, 1.0, 3.0, 2.0, 100.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, True, False]])
    # Sorted valid values 1, 2, 3, 4; position 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3) = 3.7.
    assert_close(masked_quantile(values, mask, 0.9), torch.tensor([3.7], dtype=F64), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- Eq. 5


def ref_features(logp, entropy, mask, prompt_len, area) -> np.ndarray:
    rows = []
    for i in range(logp.shape[0]):
        valid = mask[i].numpy().astype(bool)
        nll = -logp[i].double().numpy()[valid]
        n = int(valid.sum())
        mean_nll = float(nll.mean()) if n else 0.0
        q90 = float(np.quantile(nll, 0.9)) if n else 0.0
        mean_h = float(entropy[i].double().numpy()[valid].mean()) if (entropy is not None and n) else 0.0
        L = float(prompt_len[i]) if prompt_len is not None else 0.0
        a = float(area[i]) if area is not None else 0.0
        rows.append([mean_nll, q90, mean_h, float(n), L, a])
    return np.array(rows)


def make_rollout_stats(seed: int):
    g = torch.Generator().manual_seed(seed)
    n, T = 6, 12
    lengths = torch.tensor([12, 5, 0, 1, 9, 3])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    logp = -torch.rand(n, T, generator=g) * 5  # sampled-token log-probs, <= 0
    entropy = torch.rand(n, T, generator=g) * 3
    prompt_len = torch.randint(10, 600, (n,), generator=g)
    area = torch.rand(n, generator=g)
    return logp, entropy, mask, prompt_len, area


def test_feature_names_order():
    assert FEATURE_NAMES == ("mean_nll", "q90_nll", "mean_entropy", "response_len", "prompt_len", "crop_area")


def test_rollout_features_match_per_row_loop():
    logp, entropy, mask, prompt_len, area = make_rollout_stats(seed=3)
    phi = rollout_features(logp, entropy, mask, prompt_len, area)
    assert phi.dtype == torch.float32 and phi.shape == (6, 6)
    want = torch.tensor(ref_features(logp, entropy, mask, prompt_len, area), dtype=F64)
    assert_close(phi.double(), want, rtol=1e-5, atol=1e-5)
    # The empty response (row 2): zero token statistics and T_i = 0, but its prompt length and area.
    assert torch.equal(phi[2, :4], torch.zeros(4))
    assert phi[2, 4] == float(prompt_len[2]) and phi[2, 5] == float(area[2])


def test_rollout_features_ignore_padding_contents():
    logp, entropy, mask, prompt_len, area = make_rollout_stats(seed=4)
    base = rollout_features(logp, entropy, mask, prompt_len, area)
    logp2, ent2 = logp.clone(), entropy.clone()
    logp2[~mask] = -1e4
    ent2[~mask] = 1e4
    assert torch.equal(rollout_features(logp2, ent2, mask, prompt_len, area), base)
    # An integer 0/1 mask gives the same features as a boolean one.
    assert torch.equal(rollout_features(logp, entropy, mask.long(), prompt_len, area), base)


def test_rollout_features_unavailable_inputs_are_zero():
    logp, entropy, mask, prompt_len, area = make_rollout_stats(seed=5)
    full = rollout_features(logp, entropy, mask, prompt_len, area)
    none = rollout_features(logp, None, mask, None, None)
    assert torch.equal(none[:, 2], torch.zeros(6))
    assert torch.equal(none[:, 4], torch.zeros(6))
    assert torch.equal(none[:, 5], torch.zeros(6))
    assert torch.equal(none[:, [0, 1, 3]], full[:, [0, 1, 3]])
    want = torch.tensor(ref_features(logp, None, mask, None, None), dtype=F64)
    assert_close(none.double(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- running normalizer


def test_running_normalizer_first_update_sets_batch_statistics():
    norm = RunningNormalizer(dim=3)
    assert torch.equal(norm.mean, torch.zeros(3)) and torch.equal(norm.var, torch.ones(3))
    x = torch.tensor([[1.0, 10.0, -2.0], [3.0, 10.0, 0.0], [5.0, 10.0, 8.0]])
    norm.update(x)
    # Column means 3, 10, 2; population variances (4+0+4)/3, 0, (16+4+36)/3.
    assert_close(norm.mean, torch.tensor([3.0, 10.0, 2.0]))
    assert_close(norm.var, torch.tensor([8 / 3, 0.0, 56 / 3]))
    assert norm.count == 1


def test_running_normalizer_exponential_updates_by_hand():
    m = 0.9
    norm = RunningNormalizer(dim=2, momentum=m, eps=1e-6)
    b1 = torch.tensor([[0.0, 1.0], [2.0, 3.0]])  # mean (1, 2), var (1, 1)
    b2 = torch.tensor([[4.0, 0.0], [4.0, 4.0], [4.0, 8.0]])  # mean (4, 4), var (0, 32/3)
    b3 = torch.tensor([[-1.0, 2.0]])  # mean (-1, 2), var (0, 0)
    norm.update(b1)
    norm.update(b2)
    mean2 = [0.9 * 1 + 0.1 * 4, 0.9 * 2 + 0.1 * 4]  # 1.3, 2.2
    var2 = [0.9 * 1 + 0.1 * 0, 0.9 * 1 + 0.1 * 32 / 3]  # 0.9, 1.96667
    assert_close(norm.mean, torch.tensor(mean2))
    assert_close(norm.var, torch.tensor(var2))
    norm.update(b3)
    mean3 = [0.9 * mean2[0] + 0.1 * -1, 0.9 * mean2[1] + 0.1 * 2]  # 1.07, 2.18
    var3 = [0.9 * var2[0], 0.9 * var2[1]]
    assert_close(norm.mean, torch.tensor(mean3))
    assert_close(norm.var, torch.tensor(var3))
    assert norm.count == 3
    # An empty batch changes nothing.
    norm.update(torch.zeros(0, 2))
    assert_close(norm.mean, torch.tensor(mean3)) and norm.count == 3


def test_running_normalizer_default_momentum_is_099():
    norm = RunningNormalizer(dim=1)
    norm.update(torch.tensor([[0.0], [2.0]]))  # mean 1, var 1
    norm.update(torch.tensor([[11.0], [11.0]]))  # mean 11, var 0
    assert_close(norm.mean, torch.tensor([0.99 * 1 + 0.01 * 11]))
    assert_close(norm.var, torch.tensor([0.99]))


def test_running_normalizer_normalization_formula():
    norm = RunningNormalizer(dim=3, eps=1e-6)
    x = torch.tensor([[1.0, 10.0, -2.0], [3.0, 10.0, 0.0], [5.0, 10.0, 8.0]])
    norm.update(x)
    y = torch.tensor([[2.0, 11.0, 4.0]])
    want = [(2 - 3) / (8 / 3 + 1e-6) ** 0.5, (11 - 10) / (0 + 1e-6) ** 0.5, (4 - 2) / (56 / 3 + 1e-6) ** 0.5]
    assert_close(norm(y), torch.tensor([want]), rtol=1e-5, atol=1e-5)
    # The call does not change the statistics.
    assert_close(norm.mean, torch.tensor([3.0, 10.0, 2.0]))


def test_running_normalizer_state_dict_round_trip():
    g = torch.Generator().manual_seed(6)
    a = RunningNormalizer(dim=6)
    for _ in range(3):
        a.update(torch.randn(10, 6, generator=g) * 4 + 2)
    state = normalizer_state(a)
    b = RunningNormalizer(dim=6)
    load_normalizer_state(b, state)
    x = torch.randn(5, 6, generator=g)
    assert torch.equal(a(x), b(x)) and b.count == 3
    # The saved state is a copy: later updates of `a` do not change it, and both continue alike.
    batch = torch.randn(7, 6, generator=g)
    a.update(batch)
    assert not torch.equal(state["mean"], a.mean)
    b.update(batch)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.var, b.var)
