"""What a model is and which drafts fit it, read from config.json and safetensors headers without torch:
the planner prices models by these rules and the engine loads them by the same ones."""
