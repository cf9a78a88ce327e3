"""specdecode operator: reconciles SpecDecodeDeployment objects."""
