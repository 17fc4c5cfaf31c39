"""astrai.inference.server"""
