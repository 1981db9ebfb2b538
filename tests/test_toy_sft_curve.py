"""The copy probe of experiments/toy_sft_curve.py scores exactly the copied numbers."""
import os
import re
import types

from rstar_jax import config_utils
from rstar_jax.data import toy_task
from rstar_jax.rollout import chat
from experiments import toy_sft_curve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_copy_probe_masks_the_digits_of_the_code_and_of_the_answer():
  config = config_utils._load_config_file(os.path.join(REPO, "experiments/configs/toy.py"))
  tok = toy_task.train_toy_tokenizer(n=300, seed=0)
  ctx = types.SimpleNamespace(config=config, tokenizer=tok,
                              proto=chat.ChatProtocol(tok, toy_task.toy_chat_config()))
  arr, mask, in_code, kinds = toy_sft_curve.copy_probe(ctx, 24, seed=5)
  problems = toy_task.generate_problems(24, seed=5, levels=[1, 2])
  assert kinds == [p.kind for p in problems]
  for i, p in enumerate(problems):
    targets = arr["target_ids"][i]
    code = tok.decode([int(t) for t, m, c in zip(targets, mask[i], in_code[i]) if m and c])
    answer = tok.decode([int(t) for t, m, c in zip(targets, mask[i], in_code[i])
                         if m and not c])
    expr = re.search(r"print\((.*)\)$", p.code).group(1)
    # Every digit the assistant writes is a copy: the operands (never the prompt's own
    # copy of them), then the printed result, twice (restated, then boxed).
    assert code == re.sub(r"\D", "", expr), (p.problem, code)
    assert answer == str(p.answer) * 2, (p.problem, answer)
