# JupyterLab with the lab on a CPU, for machines where the Triton wheels do not install natively
# (macOS, Windows): Linux in a container, the kernels under the Triton interpreter.
#   docker build -t moelora-lab .
#   docker run --rm -p 8888:8888 moelora-lab        # then open the URL it prints
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /lab
COPY . .
# PyTorch's CPU index next to PyPI: torch 2.13.0+cpu (~200 MB) instead of the CUDA build
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN make venv
EXPOSE 8888
CMD ["make", "lab", "LAB_ARGS=--ip=0.0.0.0 --no-browser"]
