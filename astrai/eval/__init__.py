"""astrai.eval"""
