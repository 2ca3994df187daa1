"""llmopt.passes"""
