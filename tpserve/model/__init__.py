"""The model: configs, layers, weight loading, KV pool, attention back-ends, sampling."""
