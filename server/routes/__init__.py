"""One router per concern: native generation and dumps (`native`), the OpenAI-compatible API (`openai`), the
tokenizer (`tokenizer`), operations (`ops`), the residual-stream lab and its viewer (`lab`), SAE features and
steering vectors (`sae`), gradients and attribution (`gradients`); what they share in `deps`."""
