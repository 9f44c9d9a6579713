"""Install the RL post-training engine: packages `engine`, `parallel`, `algorithms` and the Hydra configs.

CPU machines: `pip install torch==2.13.0` first (a local CPU wheel here), then `pip install -e .[test]`.
GPU machines: install the CUDA build of torch that matches your driver first; the torch range below
is then already satisfied and pip installs nothing more for it.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-rl-engine",
    version="0.1.0",
    description="RL post-training (PPO, GRPO and relatives) on megatron-core with a 3D-HybridEngine",
    python_requires=">=3.10",
    packages=find_packages(
        include=[
            "engine",
            "engine.*",
            "parallel",
            "parallel.*",
            "algorithms",
            "algorithms.*",
            "conf",
            "conf.*",
        ]
    ),
    package_data={"conf": ["*.yaml", "*/*.yaml"], "engine": ["assets/*"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.6,<2.15",
        "megatron-core>=0.16.0,<0.17",
        "hydra-core>=1.3.2,<1.4",
        "omegaconf>=2.3,<2.4",
        "pyarrow>=14",
        "transformers>=4.51,<6",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "numpy>=1.26",
        "tqdm>=4.66",
    ],
    extras_require={
        # triton: the rollout's GPU kernels run under Triton's interpreter in the CPU tests
        # (tests/engine/test_triton_cpu.py); a CUDA build of torch brings its own, which satisfies this
        "test": [
            "pytest>=8",
            "ruff>=0.6",
            "matplotlib>=3.7",
            "triton>=3.2; platform_system == 'Linux' and platform_machine == 'x86_64'",
        ],
        "plot": ["matplotlib>=3.7"],
        "vllm": ["vllm>=0.26,<0.27"],
        "te": ["transformer-engine[pytorch]>=2.0"],
        "wandb": ["wandb>=0.17"],
        "tensorboard": ["tensorboard>=2.15"],
    },
)
