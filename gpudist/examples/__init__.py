"""Runnable examples: ``python -m gpudist.examples.lenet5`` trains LeNet-5 on MNIST
sequentially and distributed over 4 workers and compares the two."""
