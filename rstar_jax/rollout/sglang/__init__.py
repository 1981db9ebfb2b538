"""The SGLang client: wire format, transport, admin calls and checks, the engine."""
