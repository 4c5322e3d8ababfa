"""The gateway's HTTP front: the OpenAI API, type-ahead and warmup for browsers, health, metrics, the demo page."""
