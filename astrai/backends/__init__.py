"""Device backends: everything that exists only to make one kind of hardware fast.

The model (astrai/model) is plain PyTorch; a backend reaches it through narrow interfaces
only - an attention backend the model calls once per layer for cached attention, a model
runner that prepares a model for serving and runs the scheduler's steps, explicit opt-ins
for training's fast products, and one explicit process-tuning call.
"""
