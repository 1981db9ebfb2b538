"""What every trainer shares: the jitted micro-batched update core and interrupt handling."""
