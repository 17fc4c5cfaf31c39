"""astrai.tokenize"""
