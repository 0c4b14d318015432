"""The vllm-supervisor daemon: lifecycle, HTTP front and command line."""
