"""Development tools shared by the tests, the demo, the benchmarks and the Makefile: the local
Kubernetes control plane built from Go modules (``devtools.cluster``), small and published model
checkpoints written locally (``checkpoints``, ``tiny_models``, ``deepseek_models``), and the
SmolLM2-135M-Instruct fixture (``smollm2``). Never imported by the operator or the worker."""
