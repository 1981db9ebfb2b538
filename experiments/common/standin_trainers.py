"""Stand-in trainer programs for the fault benchmark (`experiments/benchmarks/fault_recovery.py`)
and the cluster tests (`tests/test_cluster.py`): what a trainer does with the fleet, without
JAX, so that a fault's recovery is timed and checked apart from a real trainer's start-up.
"""

# A trainer process that runs a tool call every 0.05 s through the real tools client
# (following the fleet file when given one) and logs each start's URLs ("starts") and
# each call's URLs, status and output ("calls") under $FLEET_TRAINER_WORK.
URL_TRAINER = '''
import ast, asyncio, json, os, sys, time
work = os.environ["FLEET_TRAINER_WORK"]
arg = lambda k: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(k + "=")), "")
urls, urls_file = ast.literal_eval(arg("--config.tools.urls")), arg("--config.tools.urls_file")
with open(os.path.join(work, "starts"), "a") as f:
  f.write(json.dumps(list(urls)) + "\\n")
from rstar_jax.rollout import chat
from rstar_jax.rollout.sandbox_client import ToolsConfig, build_tools

async def one(tools):
  try:
    return await tools.execute([chat.ParsedToolCall(name="python", code="print(7)", input="")])
  finally:
    await tools.release_loop()

with build_tools(ToolsConfig(urls=tuple(urls), urls_file=urls_file, timeout_s=30)) as tools:
  while not os.path.exists(os.path.join(work, "done")):
    out = asyncio.run(one(tools))[0]
    with open(os.path.join(work, "calls"), "a") as f:
      f.write(json.dumps({"urls": tools.urls, "status": out["status"],
                          "stdout": out.get("stdout", "")}) + "\\n")
    time.sleep(0.05)
'''
