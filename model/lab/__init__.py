"""The lab's methods that read or edit the network through its hook points: sparse-autoencoder features,
steering, gradients and attribution. The network itself (`model/gpt.py`) knows nothing of them."""
