"""Weight quantization: how a linear layer's weight is stored and multiplied."""
