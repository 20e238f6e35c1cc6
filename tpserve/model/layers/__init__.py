"""Small model layers: RMSNorm, rotary embedding, the SwiGLU MLP."""
