"""Group-relative advantages against a plain-numpy reference."""
import math

import numpy as np
import pytest

from rstar_jax.rl import advantages as adv
from rstar_jax.rl.advantages import AdvantageConfig


def _ref_grpo(r, eps, ddof):
  n = len(r)
  mean = sum(r) / n
  var = sum((x - mean) ** 2 for x in r) / (n - ddof)
  return [(x - mean) / (math.sqrt(var) + eps) for x in r]


GROUPS = [
    [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0],
    [1.0] + [0.0] * 15,
    [0.0] * 15 + [1.0],
    [0.3, 0.9, 0.1],
]


@pytest.mark.parametrize("rewards", GROUPS)
@pytest.mark.parametrize("eps", [1e-6, 0.1])
@pytest.mark.parametrize("ddof", [0, 1])
def test_grpo_matches_reference(rewards, eps, ddof):
  got = adv.group_advantages(rewards, AdvantageConfig(eps=eps, std_ddof=ddof))
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, _ref_grpo(rewards, eps, ddof), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rewards", GROUPS)
@pytest.mark.parametrize("name", ["dr_grpo", "dr-grpo"])
def test_dr_grpo_has_no_std(rewards, name):
  got = adv.group_advantages(rewards, AdvantageConfig(estimator=name))
  mean = sum(rewards) / len(rewards)
  np.testing.assert_allclose(got, [x - mean for x in rewards], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_equal_rewards_give_zero(name, value):
  got = adv.group_advantages([value] * 16, AdvantageConfig(estimator=name))
  np.testing.assert_array_equal(got, np.zeros(16, np.float32))


def test_single_rollout_and_empty_groups():
  np.testing.assert_array_equal(adv.group_advantages([1.0]), [0.0])
  out = adv.compute_advantages([[1.0, 0.0], [], [0.0, 0.0, 1.0]])
  assert [o.size for o in out] == [2, 0, 3]
  np.testing.assert_allclose(out[0], _ref_grpo([1.0, 0.0], 1e-6, 1), rtol=1e-6)


def test_default_is_sample_std_of_the_kept_group():
  # 8 positives of 16 -> sample std = sqrt(16/15) * 0.5.
  r = [1.0] * 8 + [0.0] * 8
  got = adv.group_advantages(r)
  np.testing.assert_allclose(got[0], 0.5 / (0.5 * math.sqrt(16 / 15) + 1e-6), rtol=1e-6)


def test_validation_and_registry():
  with pytest.raises(ValueError, match="known"):
    AdvantageConfig(estimator="ppo")
  with pytest.raises(ValueError, match="eps"):
    AdvantageConfig(eps=-1.0)
  with pytest.raises(ValueError, match="std_ddof"):
    AdvantageConfig(std_ddof=2)
  with pytest.raises(ValueError, match="group 1"):
    adv.compute_advantages([[1.0], [float("nan")]])
  with pytest.raises(ValueError, match="1-D"):
    adv.group_advantages([[1.0, 0.0]])
  assert {"grpo", "dr_grpo"} <= set(adv.ESTIMATORS)


def test_eps_must_be_positive():
  """eps 0 turned an all-equal group into 0 / 0 = NaN advantages."""
  with pytest.raises(ValueError, match="eps must be finite and > 0, got 0"):
    AdvantageConfig(eps=0.0)
  assert list(adv.group_advantages([1.0, 1.0, 1.0], AdvantageConfig())) == [0.0, 0.0, 0.0]
