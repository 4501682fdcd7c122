"""specrt.plugins: custom ops (TreeAttention, ConfidenceTruncate) arrive with the export issue."""
