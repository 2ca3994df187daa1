"""llmopt.compiler"""
