"""The speculation math: sampling, draft trees and decoding modes; tensors only, no model."""
