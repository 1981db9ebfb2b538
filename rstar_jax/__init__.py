"""rstar_jax: rStar2-Agent (agentic RL with a Python tool) in JAX/Flax NNX."""
