"""What a request's consumer is told: events, stop checks, text, prompt logprobs, its reader's lag."""
