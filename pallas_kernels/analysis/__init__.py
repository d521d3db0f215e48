"""What the kernels cost and how they compile, for checks and benchmarks (the kernels never import it): the TPU
cost model priced from the TPU plan, the Triton lowering report and the H200 ahead-of-time compile."""
