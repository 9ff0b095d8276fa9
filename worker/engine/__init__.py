"""The engine loop and its sequences: one llama.cpp context, its rounds, and what a sequence evaluates and generates."""
