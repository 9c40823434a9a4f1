"""The built-in tiny models: their task family, character tokenizer, training and evaluation."""
