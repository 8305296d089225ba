"""One router per concern: native generation and dumps, the OpenAI-compatible API, the tokenizer, operations."""
